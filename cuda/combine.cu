// Combine in one launch: the send half, then the receive half (combine_send.cu, combine_recv.cu).
#include "alltoall.cuh"

using namespace moecomm;

// grid: world * parts blocks, all resident (as moecomm_dispatch, dispatch.cu). Each block sends the
// expert outputs of its records, then sums its tokens once every expert rank has signalled. Streamed form,
// with partial sums where f.comb_streamed (prefill-sized batches, DP size 1, the padded layout, a transport
// that gains by it: gpu_plan.py, combine_streams; compiled in only where MOECOMM_STREAMS_COMBINE): this
// rank's own partial sums are never formed. The blocks of its own records go straight to the token side,
// which sums each token's own expert rows with the peers' partial sums as these land (arrival words), while
// the other blocks send; those join the token side once sent. Every block reads the call number before it
// counts itself done in the send half, so before the send half's last block advances it.
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_combine(const Fixed f, const Call c) {
  after_previous_kernel();
  TRACE_SPAN(MOECOMM_TRACE_COMBINE_SEND, 0);
  const bool stream = MOECOMM_STREAMS_COMBINE && f.comb_streamed && c.partials;
  combine_recv<false>(f, c, combine_send<false>(f, c, stream), stream);
  TRACE_SPAN(MOECOMM_TRACE_COMBINE_SEND, 1);
}

// On the FP8 combine wire (never streamed: moecomm/transport/gpu_plan.py, combine_streams).
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_combine_wire(const Fixed f, const Call c) {
  after_previous_kernel();
  TRACE_SPAN(MOECOMM_TRACE_COMBINE_SEND, 0);
  combine_recv<true>(f, c, combine_send<true>(f, c, false), false);
  TRACE_SPAN(MOECOMM_TRACE_COMBINE_SEND, 1);
}
