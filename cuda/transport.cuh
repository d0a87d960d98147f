// moecomm device-side transport layer: the operations kernels use to reach peers, and nothing else.
//
// One header per transport implements them; the build names it, MOECOMM_TRANSPORT_HEADER, and says whether it
// puts, MOECOMM_HAS_PUTS (moecomm/_jit.py, VARIANTS: a transport's registry entry):
//   put_signal_warp  copy bytes to a peer's symmetric buffer, then add to a signal there (ordered after data)
//   put_block        copy bytes to a peer's symmetric buffer, all threads of a block together
//                    (non-blocking; complete with quiet)
//   quiet            complete this thread's puts (stores to mapped peers are made visible by a fence:
//                    fence_system, device.cuh)
//   signal_set       set a 64-bit word (a signal, or a word read after one) on a peer, ordered after
//                    this thread's data to it
//   word_set         set a 64-bit word on a peer that this thread's next signal_set to it publishes
//                    (no ordering of its own: the signal's carries it)
// and both share peer_ptr (below): a load/store pointer to a peer's symmetric buffer, or nullptr when it is
// not directly addressable (another node): callers must then put (put_block, put_signal_warp).
// transport_nvshmem.cuh: NVSHMEM (NVLink by load/store, InfiniBand/EFA by puts); transport_ipc.cuh: CUDA IPC
// on one node (every peer mapped, no puts). Fences, bounded waits and the error word are in device.cuh.
#pragma once
#include "device.cuh"

namespace moecomm {

// Rank pe's copy of a symmetric address of this rank, mapped for loads and stores, or nullptr. peers: the
// transport's table, filled once at init (moecomm/transport/gpu.py: the ipc heaps' bases; NVSHMEM's
// nvshmem_ptr, so a network-only peer stays unmapped): one load, where nvshmem_ptr on the device is a chain
// of lookups. MOECOMM_FORCE_PUTS=1 (a build option of the nvshmem transport) treats every rank as
// network-only, so the put path that InfiniBand/EFA peers take is exercised on a single NVLink node.
template <typename T>
__device__ __forceinline__ T* peer_ptr(const long long* peers, T* symmetric, int pe) {
#if MOECOMM_FORCE_PUTS && MOECOMM_HAS_PUTS
  return nullptr;
#else
  const long long d = peers[pe];
  return d == MOECOMM_PEER_UNMAPPED ? nullptr : (T*)((char*)symmetric + d);
#endif
}

// Whether this build reaches any peer by puts: the nvshmem build (peers on other nodes; every peer under
// MOECOMM_FORCE_PUTS). The ipc build maps every peer; it is also what an NVSHMEM group whose every peer is
// mapped runs at prefill-sized batches (moecomm/transport/gpu.py, GpuTransport.kernels), so the nvshmem
// build's kernels of those sizes serve groups with a network peer only.
constexpr bool HAS_PUTS = MOECOMM_HAS_PUTS;

}  // namespace moecomm

#include MOECOMM_TRANSPORT_HEADER
