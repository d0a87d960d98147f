// Peer check: every rank puts a known pattern into every rank's inbox with a signal and waits, bounded, for
// every peer's. The host then verifies the bytes (moecomm.Communicator.check_peers). It exercises exactly
// the operations dispatch and combine use, over whatever path NVSHMEM chose for each peer.
#include "transport.cuh"

// grid: one block per peer (world blocks), 32 threads. Parameters: struct PeerCheck (moecomm_abi.h);
// p.signals[q] must reach p.expected (1 for the first check, then 2, ...); p.err is zero before the launch.
extern "C" __global__ void moecomm_peer_check(const moecomm::PeerCheck p) {
  const int me = p.rank;
  const int peer = blockIdx.x;
  const uint64_t deadline = moecomm::now_ns() + p.timeout_ns;
  if (peer >= p.world) return;
  moecomm::put_signal_warp(p.peers, p.inbox + (size_t)me * p.row_bytes, p.outbox, p.nbytes, &p.signals[me], 1, peer);
  __syncwarp();
  if (threadIdx.x == 0) {
    moecomm::quiet();
    moecomm::wait_geq(&p.signals[peer], p.expected, deadline, p.err, p.gone, peer, MOECOMM_PHASE_PEER_CHECK,
                      (int)p.expected);
  }
}
