// The NVSHMEM transport's device operations (see transport.cuh): stores where nvshmem_ptr maps a peer (NVLink;
// the peer table holds what it returned), NVSHMEM puts where it does not (InfiniBand/EFA through IBGDA or the
// proxy).
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

__device__ __forceinline__ void put_signal_warp(const long long*, void* dst, const void* src, size_t bytes,
                                                uint64_t* sig, uint64_t add, int pe) {
  nvshmemx_putmem_signal_nbi_warp(dst, src, bytes, sig, add, NVSHMEM_SIGNAL_ADD, pe);
}

__device__ __forceinline__ void put_block(void* dst, const void* src, size_t bytes, int pe) {
  nvshmemx_putmem_nbi_block(dst, src, bytes, pe);
}

__device__ __forceinline__ void quiet() { nvshmem_quiet(); }

// Set a signal on pe, after this thread's earlier puts and stores to pe: a release store where the peer
// is mapped, else an NVSHMEM signal operation behind a fence.
__device__ __forceinline__ void signal_set(const long long* peers, uint64_t* sig, uint64_t value, int pe) {
  if (uint64_t* p = peer_ptr(peers, sig, pe)) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(value) : "memory");
  } else {
    nvshmem_fence();
    nvshmemx_signal_op(sig, value, NVSHMEM_SIGNAL_SET, pe);
  }
}

// Set a word on pe that this thread's next signal_set to pe publishes (its release, or the fence before its
// signal op, orders the word first): no fence of its own.
__device__ __forceinline__ void word_set(const long long* peers, uint64_t* word, uint64_t value, int pe) {
  if (uint64_t* p = peer_ptr(peers, word, pe)) store_relaxed(p, value);
  else nvshmemx_signal_op(word, value, NVSHMEM_SIGNAL_SET, pe);
}

}  // namespace moecomm
