// Dispatch in one launch: the send half, then the receive half (dispatch_send.cu, dispatch_recv.cu).
#include "alltoall.cuh"

using namespace moecomm;

// grid: world * parts blocks, all resident (moecomm/transport/gpu_plan.py: the grid rule, and the residency
// check before this kernel is chosen). Every block sends its tokens (f.senders: the whole grid), then unpacks
// records. A block waits for peers only after its own sends, so the grid cannot wait on itself.
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_dispatch(const Fixed f, const Call c) {
  after_previous_kernel();
  TRACE_SPAN(MOECOMM_TRACE_DISPATCH_SEND, 0);
  dispatch_send<false, true>(f, c, f.senders);
  dispatch_recv(f, c, true);
  TRACE_SPAN(MOECOMM_TRACE_DISPATCH_SEND, 1);
}

// The same for streamed batches (f.streamed; moecomm/transport/gpu_plan.py, whole_kernels): the first f.senders blocks
// send their tokens, each routing one while it sends the one before (dispatch_send.cu; in the build without
// puts, which every group of mapped peers runs at these sizes), then unpack records; the others unpack from
// the start, as records land.
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_dispatch_streamed(const Fixed f, const Call c) {
  after_previous_kernel();
  TRACE_SPAN(MOECOMM_TRACE_DISPATCH_SEND, 0);
  dispatch_send<true, true>(f, c, f.senders);
  dispatch_recv(f, c, true);
  TRACE_SPAN(MOECOMM_TRACE_DISPATCH_SEND, 1);
}
