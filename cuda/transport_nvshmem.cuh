// The NVSHMEM transport's device operations (see transport.cuh): stores through nvshmem_ptr where a peer is
// mapped (NVLink), NVSHMEM puts where it is not (InfiniBand/EFA through IBGDA or the proxy).
#pragma once
#include "device.cuh"

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

__device__ __forceinline__ void put_signal_warp(void* dst, const void* src, size_t bytes, uint64_t* sig,
                                                uint64_t add, int pe) {
  nvshmemx_putmem_signal_nbi_warp(dst, src, bytes, sig, add, NVSHMEM_SIGNAL_ADD, pe);
}

__device__ __forceinline__ void put_block(void* dst, const void* src, size_t bytes, int pe) {
  nvshmemx_putmem_nbi_block(dst, src, bytes, pe);
}

__device__ __forceinline__ void quiet() { nvshmem_quiet(); }

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
  if (used_puts) quiet();
  __threadfence_system();
}

}  // namespace moecomm
