// Peer check: every rank puts a known pattern into every rank's inbox with a signal and waits, bounded, for
// every peer's. The host then verifies the bytes (moecomm.Communicator.check_peers). It exercises exactly
// the operations dispatch and combine use, over whatever path NVSHMEM chose for each peer.
#include "transport.cuh"

// grid: one block per peer (n_pes blocks), 32 threads.
//   inbox    symmetric uint8 [n_pes, row_bytes]: row p receives peer p's pattern (nbytes <= row_bytes)
//   outbox   symmetric uint8 [>= nbytes]: this rank's pattern
//   signals  symmetric uint64 [n_pes]: signals[p] counts the checks whose data from p has landed
//   expected value signals[p] must reach in this check (1 for the first check, then 2, ...)
//   err      int32 [MOECOMM_ERROR_WORDS], zero before the launch
extern "C" __global__ void moecomm_peer_check(uint8_t* inbox, const uint8_t* outbox, uint64_t* signals,
                                              uint64_t expected, uint64_t nbytes, uint64_t row_bytes,
                                              uint64_t timeout_ns, int* err) {
  const int me = nvshmem_my_pe();
  const int peer = blockIdx.x;
  const uint64_t deadline = moecomm::now_ns() + timeout_ns;
  if (peer >= nvshmem_n_pes()) return;
  moecomm::put_signal_warp(inbox + (size_t)me * row_bytes, outbox, nbytes, &signals[me], 1, peer);
  __syncwarp();
  if (threadIdx.x == 0) {
    moecomm::complete_sends(true);
    moecomm::wait_geq(&signals[peer], expected, deadline, err, peer, MOECOMM_PHASE_PEER_CHECK);
  }
}
