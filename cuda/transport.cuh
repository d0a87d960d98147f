// moecomm device-side transport layer: the operations kernels use to reach peers, and nothing else.
//
// One header per transport implements them; the build defines which (moecomm/_jit.py, VARIANTS):
//   put_signal_warp  copy bytes to a peer's symmetric buffer, then add to a signal there (ordered after data)
//   put_block        copy bytes to a peer's symmetric buffer, all threads of a block together
//                    (non-blocking; complete with quiet)
//   quiet            complete this thread's puts
//   signal_set       set a 64-bit word (a signal, or a word read after one) on a peer, ordered after
//                    this thread's data to it
//   complete_sends   finish a thread's puts and stores before it (or its block) signals
//   peer_ptr         a load/store pointer to a peer's symmetric buffer, or nullptr when it is not
//                    directly addressable (another node): callers must then put (put_block, put_signal_warp)
// transport_nvshmem.cuh: NVSHMEM (NVLink by load/store, InfiniBand/EFA by puts); transport_ipc.cuh: CUDA IPC
// on one node (every peer mapped, no puts). Bounded waits and the error word are in device.cuh.
#pragma once
#include "device.cuh"

#if MOECOMM_TRANSPORT_IPC
#include "transport_ipc.cuh"
#else
#include "transport_nvshmem.cuh"
#endif
