// The IPC transport's device operations (see transport.cuh): the ranks of one node map each other's
// symmetric heap (CUDA IPC, moecomm/transport/ipc.py), so every peer is load/store reachable: data and
// signals are stores through peer pointers and there are no puts.
#pragma once
#include "device.cuh"

namespace moecomm {

// Warp-wide: copy bytes into pe's buffer, make them visible, then add to pe's signal.
__device__ __forceinline__ void put_signal_warp(const long long* peers, void* dst, const void* src, size_t bytes,
                                                uint64_t* sig, uint64_t add, int pe) {
  uint8_t* d = peer_ptr(peers, (uint8_t*)dst, pe);
  const uint8_t* s = (const uint8_t*)src;
  for (size_t i = threadIdx.x & 31; i < bytes; i += 32) d[i] = s[i];
  __threadfence_system();
  __syncwarp();
  if ((threadIdx.x & 31) == 0)
    atomicAdd_system((unsigned long long*)peer_ptr(peers, sig, pe), (unsigned long long)add);
}

// Every peer is mapped (peer_ptr never returns nullptr), so kernels never put: reaching this is a bug.
__device__ __forceinline__ void put_block(void*, const void*, size_t, int) { __trap(); }

__device__ __forceinline__ void quiet() {}

// Set a signal on pe, after this thread's earlier stores to pe (release store).
__device__ __forceinline__ void signal_set(const long long* peers, uint64_t* sig, uint64_t value, int pe) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(peer_ptr(peers, sig, pe)), "l"(value) : "memory");
}

// Set a word on pe that this thread's next signal_set to pe publishes (its release orders the word first): no
// fence of its own.
__device__ __forceinline__ void word_set(const long long* peers, uint64_t* word, uint64_t value, int pe) {
  store_relaxed(peer_ptr(peers, word, pe), value);
}

}  // namespace moecomm
