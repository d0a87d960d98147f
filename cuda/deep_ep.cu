// DeepEP's profiler names (moecomm.compat.deep_ep: AllToAll(kernel_names="deep_ep")): DeepEP's tests time its
// low-latency calls by the kernels whose names hold `dispatch` and `combine`, one kernel per phase, the
// halves of a receive hook found as `::dispatch` / `::combine`. These run the half their Half parameter names
// (gpu_plan.py: half_kernels), the halves' own code (dispatch_send.cu, dispatch_recv.cu, combine_send.cu,
// combine_recv.cu); on an FP8 combine wire the combine keeps its own kernels.
#include "alltoall.cuh"

namespace moecomm::deep_ep {

__global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    dispatch(const Fixed f, const Call c, const Half h) {
  after_previous_kernel();
  if (h.recv) {
    TRACE_SPAN(MOECOMM_TRACE_DISPATCH_RECV, 0);
    dispatch_recv(f, c);
    TRACE_SPAN(MOECOMM_TRACE_DISPATCH_RECV, 1);
  } else {
    TRACE_SPAN(MOECOMM_TRACE_DISPATCH_SEND, 0);
    dispatch_send<false>(f, c, gridDim.x);
    TRACE_SPAN(MOECOMM_TRACE_DISPATCH_SEND, 1);
  }
}

__global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    combine(const Fixed f, const Call c, const Half h) {
  after_previous_kernel();
  if (h.recv) {
    TRACE_SPAN(MOECOMM_TRACE_COMBINE_RECV, 0);
    combine_recv<false>(f, c, f.state[MOECOMM_S_EPOCH_CS], false);
    TRACE_SPAN(MOECOMM_TRACE_COMBINE_RECV, 1);
  } else {
    TRACE_SPAN(MOECOMM_TRACE_COMBINE_SEND, 0);
    combine_send<false>(f, c, false);
    TRACE_SPAN(MOECOMM_TRACE_COMBINE_SEND, 1);
  }
}

}  // namespace moecomm::deep_ep
