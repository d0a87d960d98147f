// Dispatch in one launch: the send half, then the receive half (dispatch_send.cu, dispatch_recv.cu).
#include "alltoall.cuh"

using namespace moecomm;

// grid: world * parts blocks, all resident (moecomm/_abi.py: the grid rule, and the residency check before
// this kernel is chosen). The first f.senders blocks send their tokens, then unpack records; the others
// (f.streamed: a batch large enough for records to stream) unpack from the start, as records land. A block
// waits for peers only after its own sends, so the grid cannot wait on itself.
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_dispatch(const Fixed f, const Call c) {
  TRACE_SPAN(MOECOMM_TRACE_DISPATCH_SEND, 0);
  dispatch_send(f, c, f.senders);
  dispatch_recv(f, c);
  TRACE_SPAN(MOECOMM_TRACE_DISPATCH_SEND, 1);
}
