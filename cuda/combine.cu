// Combine in one launch: the send half, then the receive half (combine_send.cu, combine_recv.cu).
#include "alltoall.cuh"

using namespace moecomm;

// grid: world * parts blocks, all resident (as moecomm_dispatch, dispatch.cu). Each block sends the
// expert outputs of its records, then sums its tokens once every expert rank has signalled.
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_combine(const Fixed f, const Call c) {
  combine_send(f, c);
  combine_recv(f, c);
}
