// Dispatch, send half: route this rank's share of the tokens to the ranks owning their experts.
#include "alltoall.cuh"

using namespace moecomm;

// grid: any number of blocks of MOECOMM_BLOCK_THREADS; one warp per token (strided).
//   layout, state   this AllToAll's layout (int64) and device state (uint32, MOECOMM_S_* indices)
//   err             int32[4] error word (mapped host memory)
//   x [rows, hidden] in_dtype bytes; x_scale [rows, scales] float32 or null; indices [rows, topk] int32;
//   weights [rows, topk] float32 or null; bound_m [1] int32: m, this group's token count
//   recv_buf        symmetric [world, max_tokens, rec_bytes]: row [me][slot] on each destination
//   sig             symmetric uint64 [world]: sig[me] on each destination gets (epoch | flags | count)
//   stage           symmetric staging rows (put sources for peers without a load/store mapping)
// This rank sends the tokens t = dp_rank, dp_rank + dp, ... < m of its DP group, each once per
// destination rank: the token row is read once and stored into every mapped destination.
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS)
    moecomm_dispatch_send(const long long* layout, unsigned* state, int* err, const uint8_t* x,
                          const float* x_scale, const int* indices, const float* weights, const int* bound_m,
                          int rows, uint8_t* recv_buf, uint64_t* sig, uint8_t* stage) {
  const Layout L(layout);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gwarp = blockIdx.x * WARPS + warp, nwarps = gridDim.x * WARPS;
  const unsigned epoch = state[MOECOMM_S_EPOCH_DS] + 1;
  __shared__ uint8_t* dsts[WARPS][MAX_FANOUT];
  __shared__ uint8_t* remote[WARPS][MAX_FANOUT];
  __shared__ int pes[WARPS][MAX_FANOUT];
  int m = *bound_m;
  if (m < 0 || m > rows || m > L.max_tokens) {
    if (gwarp == 0 && lane == 0) {
      record_error(err, MOECOMM_ERR_BAD_M, L.rank, MOECOMM_PHASE_DISPATCH, m);
      atomicOr(&state[MOECOMM_S_BAD], 1u);
    }
    m = 0;
  }
  Stage st(stage, L, gwarp);
  for (int i = gwarp;; i += nwarps) {
    const int t = L.rank % L.dp + i * L.dp;
    if (t >= m) break;
    int e = -1, dest = -1;
    bool ok = true, first = lane < L.topk;
    if (lane < L.topk) {
      e = indices[(size_t)t * L.topk + lane];
      ok = e >= 0 && e < L.num_experts;
      dest = ok ? e / L.local_experts : -1;
    }
    for (int j = 0; j < L.topk; ++j) {  // repeated experts are invalid; repeated ranks are sent once
      const int ej = __shfl_sync(FULL, e, j), dj = __shfl_sync(FULL, dest, j);
      if (j < lane && lane < L.topk) {
        ok = ok && ej != e;
        first = first && dj != dest;
      }
    }
    if (__any_sync(FULL, !ok)) {
      if (lane == 0) {
        record_error(err, MOECOMM_ERR_BAD_EXPERT, L.rank, MOECOMM_PHASE_DISPATCH, t);
        atomicOr(&state[MOECOMM_S_BAD], 1u);
      }
      continue;
    }
    // destinations: a slot on every rank owning one of the token's experts
    int n = 0, n_put = 0;
    for (int j = 0; j < L.topk; ++j) {
      const int d = __shfl_sync(FULL, dest, j);
      if (!__shfl_sync(FULL, first, j)) continue;
      unsigned slot = 0;
      if (lane == 0) slot = atomicAdd(&state[MOECOMM_S_FIXED + d], 1u);
      slot = __shfl_sync(FULL, slot, 0);
      uint8_t* sym = recv_buf + ((size_t)L.rank * L.max_tokens + slot) * L.rec_bytes;
      uint8_t* p = peer_ptr(sym, d);
      if (lane == 0) {
        if (p) {
          dsts[warp][n] = p;
        } else {
          remote[warp][n_put] = sym;
          pes[warp][n_put] = d;
        }
      }
      p ? ++n : ++n_put;
    }
    uint8_t* staged = nullptr;
    if (n_put) {
      staged = st.next();
      if (lane == 0) dsts[warp][n] = staged;
      ++n;
    }
    __syncwarp();
    fanout16(dsts[warp], n, x + (size_t)t * L.x_bytes, L.x_bytes, 0, lane);
    if (L.scale_bytes)
      fanout4(dsts[warp], n, (const uint8_t*)(x_scale + (size_t)t * (L.scale_bytes / 4)), L.scale_bytes,
              L.x_bytes, lane);
    for (int j = 0; j < n; ++j) {
      int* meta = meta_of(dsts[warp][j], L);
      if (lane == 0) meta[0] = t;
      if (lane < L.topk) {
        meta[1 + lane] = e;
        ((float*)meta)[1 + L.topk + lane] = weights ? weights[(size_t)t * L.topk + lane] : 0.0f;
      }
    }
    __syncwarp();
    for (int j = 0; j < n_put; ++j) st.put(remote[warp][j], staged, L.rec_bytes, pes[warp][j]);
    __syncwarp();
  }
  complete_sends(st.used_puts);
  if (last_block(&state[MOECOMM_S_DONE_DS])) {
    const uint64_t bad = load_volatile((const int*)&state[MOECOMM_S_BAD]) ? SIG_BAD : 0;
    for (int d = threadIdx.x; d < L.world; d += blockDim.x) {
      const unsigned cnt = atomicExch(&state[MOECOMM_S_FIXED + d], 0u);
      signal_set(&sig[L.rank], epoch_signal(epoch, bad | cnt), d);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      state[MOECOMM_S_BAD] = 0;
      state[MOECOMM_S_DONE_DS] = 0;
      state[MOECOMM_S_EPOCH_DS] = epoch;
    }
  }
}
