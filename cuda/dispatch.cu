// Dispatch in one launch: the send half, then the receive half (dispatch_send.cu, dispatch_recv.cu).
#include "alltoall.cuh"

using namespace moecomm;

// grid: world * parts blocks, all resident (moecomm/_abi.py: the grid rule, and the residency check before
// this kernel is chosen). Each block sends its tokens, then unpacks its records: a block waits for the
// peers' signals only after its own sends, so the grid cannot wait on itself. The receive half starts
// without a kernel boundary: blocks whose sends are done begin waiting while others still send.
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_dispatch(const Fixed f, const Call c) {
  TRACE_SPAN(MOECOMM_TRACE_DISPATCH_SEND, 0);
  dispatch_send(f, c);
  dispatch_recv(f, c);
  TRACE_SPAN(MOECOMM_TRACE_DISPATCH_SEND, 1);
}
