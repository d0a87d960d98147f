// Combine in one launch: the send half, then the receive half (combine_send.cu, combine_recv.cu).
#include "alltoall.cuh"

using namespace moecomm;

// grid: world * parts blocks, all resident (as moecomm_dispatch, dispatch.cu). Each block sends the
// expert outputs of its records, then sums its tokens once every expert rank has signalled. Every block
// reads the call number before it counts itself done in the send half, so before the send half's last
// block advances it.
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_combine(const Fixed f, const Call c) {
  TRACE_SPAN(MOECOMM_TRACE_COMBINE_SEND, 0);
  combine_recv(f, c, combine_send(f, c));
  TRACE_SPAN(MOECOMM_TRACE_COMBINE_SEND, 1);
}
