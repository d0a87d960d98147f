// Shared by the four dispatch/combine kernels: the layout of one AllToAll, its device state, and helpers.
//
// Wire plan (bytes per phase are in moecomm/transport/nvshmem_alltoall.py):
//   dispatch  each token goes once to every *rank* owning one of its experts, as one record
//             [x | scales | token, expert ids[k], weights[k]] in the receiver's slot recv_buf[src][slot];
//             the receiver fans it out to its local experts.
//   combine   with the router weights from dispatch: one partial sum per (token, expert rank), out dtype,
//             into comb_buf[expert rank][token] of every rank of the token's DP group; without them: one
//             row per (token, k) into comb_buf[token][k].
// Completion: after its data, a sender sets one 64-bit signal per peer to (epoch << 32 | flags | count).
// Epochs are counted on the device (state[]), so nothing needs a host reset and CUDA graphs replay.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "transport.cuh"

namespace moecomm {

constexpr unsigned FULL = 0xffffffffu;
constexpr uint64_t SIG_BAD = 0x80000000ull;  // the sender's input was invalid: nothing was sent
constexpr uint64_t SIG_COUNT = 0x7fffffffull;

// The int64 layout array written once per AllToAll; indices MOECOMM_L_* come from Python.
struct Layout {
  int world, rank, dp, num_experts, local_experts, topk, max_tokens, hidden, x_bytes, scale_bytes,
      meta_off, rec_bytes, out_code, out_row_bytes, cap, stage_slots, stage_bytes;
  int s_expert, s_recv;  // state[] offsets of the per-local-expert and per-source counters
  __device__ explicit Layout(const long long* p)
      : world(p[MOECOMM_L_WORLD]), rank(p[MOECOMM_L_RANK]), dp(p[MOECOMM_L_DP]),
        num_experts(p[MOECOMM_L_EXPERTS]), local_experts(p[MOECOMM_L_LOCAL_EXPERTS]),
        topk(p[MOECOMM_L_TOPK]), max_tokens(p[MOECOMM_L_MAX_TOKENS]), hidden(p[MOECOMM_L_HIDDEN]),
        x_bytes(p[MOECOMM_L_X_BYTES]), scale_bytes(p[MOECOMM_L_SCALE_BYTES]),
        meta_off(p[MOECOMM_L_META_OFF]), rec_bytes(p[MOECOMM_L_REC_BYTES]),
        out_code(p[MOECOMM_L_OUT_CODE]), out_row_bytes(p[MOECOMM_L_OUT_ROW_BYTES]), cap(p[MOECOMM_L_CAP]),
        stage_slots(p[MOECOMM_L_STAGE_SLOTS]), stage_bytes(p[MOECOMM_L_STAGE_BYTES]),
        s_expert(MOECOMM_S_FIXED + world), s_recv(MOECOMM_S_FIXED + world + local_experts) {}
};

// Record metadata after x and scales: int32 token, int32 expert[topk], float weight[topk].
__device__ __forceinline__ int* meta_of(uint8_t* rec, const Layout& L) { return (int*)(rec + L.meta_off); }
__device__ __forceinline__ const int* meta_of(const uint8_t* rec, const Layout& L) {
  return (const int*)(rec + L.meta_off);
}

__device__ __forceinline__ void warp_copy16(void* dst, const void* src, int bytes, int lane) {
  const int4* s = (const int4*)src;
  int4* d = (int4*)dst;
  for (int i = lane; i < bytes / 16; i += 32) d[i] = s[i];
}

__device__ __forceinline__ void warp_copy4(void* dst, const void* src, int bytes, int lane) {
  const int* s = (const int*)src;
  int* d = (int*)dst;
  for (int i = lane; i < bytes / 4; i += 32) d[i] = s[i];
}

// A staging slot of this warp (ring of stage_slots), the source of puts to peers that are not
// load/store reachable. Before a slot is reused, the puts that read it must be complete (quiet).
struct Stage {
  uint8_t* base;
  int slots, bytes, n;
  bool puts_pending;
  __device__ Stage(uint8_t* stage, const Layout& L, int gwarp)
      : base(stage + (size_t)gwarp * L.stage_slots * L.stage_bytes), slots(L.stage_slots),
        bytes(L.stage_bytes), n(0), puts_pending(false) {}
  __device__ uint8_t* next() {
    if (puts_pending && n % slots == 0) {
      quiet();
      puts_pending = false;
    }
    return base + (size_t)(n++ % slots) * bytes;
  }
};

// Copy a warp-local row (in `src`, which must be symmetric when a put is needed) to `dst` on pe.
__device__ __forceinline__ void send_row(uint8_t* dst, const uint8_t* src, int bytes, int pe, int lane,
                                         Stage& st) {
  uint8_t* p = peer_ptr(dst, pe);
  if (p) {
    warp_copy16(p, src, bytes, lane);
  } else {
    put_warp(dst, src, bytes, pe);
    st.puts_pending = true;
  }
}

// True in every thread of the block that finishes last. All threads call it after their work.
__device__ __forceinline__ bool last_block(unsigned* done) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (last) __threadfence();
  return last;
}

// Wait (bounded) until sig's epoch reaches `epoch`; returns the signal, or 0 after a timeout or abort.
__device__ __forceinline__ uint64_t wait_epoch(const uint64_t* sig, unsigned epoch, uint64_t deadline,
                                               int* err, int peer, int phase) {
  uint64_t v;
  while (((v = load_acquire(sig)) >> 32) < epoch) {
    if (load_volatile(err) == MOECOMM_ERR_TIMEOUT) return 0;  // another wait already failed: stop
    if (now_ns() > deadline) {
      record_error(err, MOECOMM_ERR_TIMEOUT, peer, phase, 0);
      return 0;
    }
  }
  return v;
}

__device__ __forceinline__ uint64_t epoch_signal(unsigned epoch, uint64_t payload) {
  return ((uint64_t)epoch << 32) | payload;
}

// 8 values of the output dtype (16 bytes) <-> float.
__device__ __forceinline__ void load8(const uint8_t* p, int code, float* f) {
  const int4 v = *(const int4*)p;
  if (code == MOECOMM_DT_BF16) {
    const __nv_bfloat162* h = (const __nv_bfloat162*)&v;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 t = __bfloat1622float2(h[i]);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  } else {
    const __half2* h = (const __half2*)&v;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 t = __half22float2(h[i]);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  }
}

__device__ __forceinline__ void store8(uint8_t* p, int code, const float* f) {
  int4 v;
  if (code == MOECOMM_DT_BF16) {
    __nv_bfloat162* h = (__nv_bfloat162*)&v;
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  } else {
    __half2* h = (__half2*)&v;
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
  }
  *(int4*)p = v;
}

}  // namespace moecomm
