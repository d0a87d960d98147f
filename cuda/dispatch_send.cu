// Dispatch, send half: route this rank's share of the tokens to the ranks owning their experts.
#include "alltoall.cuh"

using namespace moecomm;

// grid: any number of blocks of MOECOMM_BLOCK_THREADS; one block per token (strided).
//   layout, state   this AllToAll's layout (int64) and device state (uint32, MOECOMM_S_* indices)
//   err             int32[4] error word (mapped host memory)
//   x [rows, hidden] in_dtype bytes; x_scale [rows, scales] float32 or null; indices [rows, topk] int32;
//   weights [rows, topk] float32 or null; bound_m [1] int32: m, this group's token count
//   recv_buf        symmetric [world, max_tokens, rec_bytes]: row [me][slot] on each destination
//   sig             symmetric uint64 [world]: sig[me] on each destination gets (epoch | flags | count)
//   stage           symmetric staging rows (put sources for peers without a load/store mapping)
// This rank sends the tokens t = dp_rank, dp_rank + dp, ... < m of its DP group, each once per
// destination rank: the token row is read once and stored into every mapped destination.
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, 2)
    moecomm_dispatch_send(const long long* layout, unsigned* state, int* err, const uint8_t* x,
                          const float* x_scale, const int* indices, const float* weights, const int* bound_m,
                          int rows, uint8_t* recv_buf, uint64_t* sig, uint8_t* stage) {
  const Layout L(layout);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned epoch = state[MOECOMM_S_EPOCH_DS] + 1;
  __shared__ uint8_t* dsts[MAX_FANOUT];
  __shared__ uint8_t* remote[MAX_FANOUT];
  __shared__ int pes[MAX_FANOUT];
  __shared__ int n_direct, n_put;  // destinations of the current token; n_put < 0: skip it
  int m = *bound_m;
  if (m < 0 || m > rows || m > L.max_tokens) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      record_error(err, MOECOMM_ERR_BAD_M, L.rank, MOECOMM_PHASE_DISPATCH, m);
      atomicOr(&state[MOECOMM_S_BAD], 1u);
    }
    m = 0;
  }
  Stage st(stage, L);
  for (int i = blockIdx.x;; i += gridDim.x) {
    const int t = L.rank % L.dp + i * L.dp;
    if (t >= m) break;
    // warp 0: check the token's experts, take a slot on every destination rank (in parallel lanes)
    int e = -1;
    if (warp == 0) {
      int dest = -1;
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
          n_put = -1;
        }
      } else {
        uint8_t* sym = nullptr;
        uint8_t* p = nullptr;
        if (first) {
          const unsigned slot = atomicAdd(&state[MOECOMM_S_FIXED + dest], 1u);
          sym = recv_buf + ((size_t)L.rank * L.max_tokens + slot) * L.rec_bytes;
          p = peer_ptr(sym, dest);
        }
        const unsigned direct = __ballot_sync(FULL, p != nullptr), put = __ballot_sync(FULL, first && !p);
        const unsigned below = (1u << lane) - 1;
        if (p) dsts[__popc(direct & below)] = p;
        if (first && !p) {
          remote[__popc(put & below)] = sym;
          pes[__popc(put & below)] = dest;
        }
        if (lane == 0) {
          n_direct = __popc(direct);
          n_put = __popc(put);
        }
      }
    }
    __syncthreads();
    if (n_put < 0) {  // invalid token: nothing sent
      __syncthreads();
      continue;
    }
    const int puts = n_put;
    int n = n_direct;
    if (puts) {  // one staged copy, put to every destination without a mapping
      uint8_t* staged = st.next();
      if (threadIdx.x == 0) dsts[n] = staged;
      ++n;
      __syncthreads();
    }
    fanout16(dsts, n, x + (size_t)t * L.x_bytes, L.x_bytes, 0);
    if (L.scale_bytes)
      fanout4(dsts, n, (const uint8_t*)(x_scale + (size_t)t * (L.scale_bytes / 4)), L.scale_bytes, L.x_bytes);
    if (warp == 0) {
      for (int j = 0; j < n; ++j) {
        int* meta = meta_of(dsts[j], L);
        if (lane == 0) meta[0] = t;
        if (lane < L.topk) {
          meta[1 + lane] = e;
          ((float*)meta)[1 + L.topk + lane] = weights ? weights[(size_t)t * L.topk + lane] : 0.0f;
        }
      }
    }
    __syncthreads();
    if (puts) {
      put_block_all(remote, pes, puts, dsts[n - 1], L.rec_bytes);
      __syncthreads();
    }
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
