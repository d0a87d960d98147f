// moecomm device-side transport layer: the only file that talks to NVSHMEM.
//
// Kernels use these few operations and nothing else to reach peers, so a new transport is a new version
// of this header and the kernels do not change:
//   put_signal_warp  copy bytes to a peer's symmetric buffer, then add to a signal there (ordered after data)
//   put_block        copy bytes to a peer's symmetric buffer, all threads of a block together
//                    (non-blocking; complete with quiet)
//   signal_set       set a signal on a peer, ordered after this thread's data to it
//   wait_geq         bounded wait until a local signal reaches a value; records a timeout in the error word
//   complete_sends   finish a thread's puts and stores before it (or its block) signals
//   peer_ptr         a load/store pointer to a peer's symmetric buffer, or nullptr when it is not
//                    directly addressable (another node): callers must then put (put_block, put_signal_warp)
// Constants (MOECOMM_*) and parameter structs come from the generated moecomm_abi.h (moecomm/_abi.py).
#pragma once
#include "moecomm_abi.h"

// NVSHMEM 3.4's reduce.cuh uses std:: traits without including them; under NVRTC there is no <type_traits>.
#include <cuda/std/type_traits>
namespace std {
using cuda::std::enable_if;
using cuda::std::is_integral;
using cuda::std::is_signed;
using cuda::std::is_unsigned;
}  // namespace std
#include <nvshmem.h>
#include <nvshmemx.h>

namespace moecomm {

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t load_acquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ int load_volatile(const int* p) { return *(const volatile int*)p; }

// Error word: int32[MOECOMM_ERROR_WORDS] = {code, peer, phase, detail, call}. The first error recorded
// wins, except that a timeout replaces an error of another kind (it is the one that breaks the
// communicator, so the host must see it).
__device__ __forceinline__ void record_error(int* err, int code, int peer, int phase, int detail, int call) {
  int old = atomicCAS(err, MOECOMM_ERR_NONE, code);
  if (old != MOECOMM_ERR_NONE && code == MOECOMM_ERR_TIMEOUT && old != MOECOMM_ERR_TIMEOUT)
    old = atomicCAS(err, old, code) == old ? MOECOMM_ERR_NONE : old;
  if (old == MOECOMM_ERR_NONE) {
    err[1] = peer;
    err[2] = phase;
    err[3] = detail;
    err[4] = call;
    __threadfence_system();
  }
}

// Spin until *sig >= expected. Returns false when the deadline passes (a timeout naming `peer` is
// recorded) or when another thread has recorded a timeout (so one failure stops every waiter). The clock
// and the error word (possibly in mapped host memory) are read once per POLL_CHECK spins.
constexpr unsigned POLL_CHECK = 256;
__device__ __forceinline__ bool wait_geq(const uint64_t* sig, uint64_t expected, uint64_t deadline_ns,
                                         int* err, int peer, int phase, int call) {
  for (unsigned spin = 1; load_acquire(sig) < expected; ++spin) {
    if (spin % POLL_CHECK) continue;
    if (load_volatile(err) == MOECOMM_ERR_TIMEOUT) return false;
    if (now_ns() > deadline_ns) {
      record_error(err, MOECOMM_ERR_TIMEOUT, peer, phase, 0, call);
      return false;
    }
  }
  return true;
}

__device__ __forceinline__ void put_signal_warp(void* dst, const void* src, size_t bytes, uint64_t* sig,
                                                uint64_t add, int pe) {
  nvshmemx_putmem_signal_nbi_warp(dst, src, bytes, sig, add, NVSHMEM_SIGNAL_ADD, pe);
}

__device__ __forceinline__ void put_block(void* dst, const void* src, size_t bytes, int pe) {
  nvshmemx_putmem_nbi_block(dst, src, bytes, pe);
}

// MOECOMM_FORCE_PUTS=1 (a build option) treats every peer as network-only, so the put path that
// InfiniBand/EFA peers take is exercised on a single NVLink node.
template <typename T>
__device__ __forceinline__ T* peer_ptr(T* symmetric, int pe) {
#if MOECOMM_FORCE_PUTS
  return nullptr;
#else
  return static_cast<T*>(nvshmem_ptr(symmetric, pe));
#endif
}

// Set a signal on pe, after this thread's earlier puts and stores to pe: a release store where the peer
// is mapped, else an NVSHMEM signal operation behind a fence.
__device__ __forceinline__ void signal_set(uint64_t* sig, uint64_t value, int pe) {
  if (uint64_t* p = peer_ptr(sig, pe)) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(value) : "memory");
  } else {
    nvshmem_fence();
    nvshmemx_signal_op(sig, value, NVSHMEM_SIGNAL_SET, pe);
  }
}

// Before signalling completion: finish this thread's puts (only if it issued any: nvshmem_quiet can be
// costly) and make its stores to mapped peers visible system-wide.
__device__ __forceinline__ void complete_sends(bool used_puts) {
  if (used_puts) nvshmem_quiet();
  __threadfence_system();
}

}  // namespace moecomm
