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
//   out_x, out_scale, slot_of   as in dispatch_recv: this rank's own experts, written here directly
// This rank sends the tokens t = dp_rank, dp_rank + dp, ... < m of its DP group, each once per other
// destination rank as a record (the receiver fans it out to its experts); tokens for this rank's own
// experts go straight into their expert slots, and only the record's metadata (for combine) is kept.
// The token row is read once and stored into every destination.
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, 2)
    moecomm_dispatch_send(const long long* layout, unsigned* state, int* err, const uint8_t* x,
                          const float* x_scale, const int* indices, const float* weights, const int* bound_m,
                          int rows, uint8_t* recv_buf, uint64_t* sig, uint8_t* stage, uint8_t* out_x,
                          float* out_scale, int* slot_of) {
  const Layout L(layout);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned epoch = state[MOECOMM_S_EPOCH_DS] + 1;
  // Destinations of the current token, in this order: records on mapped peers, the staged record (when
  // some peer needs a put), rows of this rank's experts. xd: where x goes, sd: where its scales go.
  // recs: records that get the metadata (mapped, staged, and this rank's own record, metadata only).
  __shared__ uint8_t* xd[MAX_FANOUT];
  __shared__ uint8_t* sd[MAX_FANOUT];
  __shared__ uint8_t* recs[MAX_FANOUT];
  __shared__ uint8_t* remote[MAX_FANOUT];
  __shared__ int pes[MAX_FANOUT];
  __shared__ int n_direct, n_put, n_local, n_meta;  // n_put < 0: skip the token (invalid)
  int m = *bound_m;
  if (m < 0 || m > rows || m > L.max_tokens) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      record_error(err, MOECOMM_ERR_BAD_M, L.rank, MOECOMM_PHASE_DISPATCH, m);
      atomicOr(&state[MOECOMM_S_BAD], 1u);
    }
    m = 0;
  }
  const int lo = L.rank * L.local_experts;
  Stage st(stage, L);
  for (int i = blockIdx.x;; i += gridDim.x) {
    const int t = L.rank % L.dp + i * L.dp;
    if (t >= m) break;
    // warp 0: check the token's experts, take slots (in parallel lanes), list the destinations
    int e = -1;
    float w = 0.0f;
    if (warp == 0) {
      int dest = -1;
      bool ok = true, first = lane < L.topk;
      if (lane < L.topk) {
        e = indices[(size_t)t * L.topk + lane];
        if (weights) w = weights[(size_t)t * L.topk + lane];
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
        const bool peer = first && dest != L.rank, local = lane < L.topk && dest == L.rank;
        uint8_t* sym = nullptr;
        uint8_t* p = peer ? peer_ptr(recv_buf, dest) : nullptr;  // resolved alongside the slot atomic
        size_t rec_off = 0;
        if (first) {
          const unsigned slot = atomicAdd(&state[MOECOMM_S_FIXED + dest], 1u);
          rec_off = ((size_t)L.rank * L.max_tokens + slot) * L.rec_bytes;
          sym = recv_buf + rec_off;
        }
        int where = -1;  // this rank's expert slot of the lane's expert
        if (local) {
          const int le = e - lo;
          const unsigned slot = atomicAdd(&state[L.s_expert + le], 1u);
          if (slot < (unsigned)L.cap) {
            where = le * L.cap + slot;
          } else {
            record_error(err, MOECOMM_ERR_OVERFLOW, L.rank, MOECOMM_PHASE_DISPATCH, le);
          }
        }
        if (p) p += rec_off;
        const unsigned direct = __ballot_sync(FULL, p != nullptr), put = __ballot_sync(FULL, peer && !p);
        const unsigned rows_here = __ballot_sync(FULL, where >= 0), own = __ballot_sync(FULL, first && local);
        const unsigned below = (1u << lane) - 1;
        const int nd = __popc(direct), staged = put ? 1 : 0;
        if (p) {
          xd[__popc(direct & below)] = p;
          sd[__popc(direct & below)] = p + L.x_bytes;
          recs[__popc(direct & below)] = p;
        }
        if (peer && !p) {
          remote[__popc(put & below)] = sym;
          pes[__popc(put & below)] = dest;
        }
        if (where >= 0) {
          const int pos = nd + staged + __popc(rows_here & below);
          xd[pos] = out_x + (size_t)where * L.x_bytes;
          sd[pos] = (uint8_t*)(out_scale + (size_t)where * (L.scale_bytes / 4));
        }
        if (own) {  // this rank's record: metadata for combine, and where each of its experts put the row
          const uint8_t* mine = (const uint8_t*)__shfl_sync(FULL, (unsigned long long)sym, __ffs(own) - 1);
          if (lane < L.topk) slot_of[(mine - recv_buf) / L.rec_bytes * L.topk + lane] = where;
          if (lane == 0) recs[nd + staged] = (uint8_t*)mine;
        }
        if (lane == 0) {
          n_direct = nd;
          n_put = __popc(put);
          n_local = __popc(rows_here);
          n_meta = nd + staged + (own ? 1 : 0);
        }
      }
    }
    __syncthreads();
    if (n_put < 0) {  // invalid token: nothing sent
      __syncthreads();
      continue;
    }
    const int puts = n_put, nd = n_direct;
    if (puts) {  // one staged record, put to every destination without a mapping
      uint8_t* staged = st.next();
      if (threadIdx.x == 0) {
        xd[nd] = recs[nd] = staged;
        sd[nd] = staged + L.x_bytes;
      }
      __syncthreads();
    }
    const int n = nd + (puts ? 1 : 0) + n_local;
    fanout16(xd, n, x + (size_t)t * L.x_bytes, L.x_bytes, 0);
    if (L.scale_bytes)
      fanout4(sd, n, (const uint8_t*)(x_scale + (size_t)t * (L.scale_bytes / 4)), L.scale_bytes, 0);
    if (warp == 0) {
      for (int j = 0; j < n_meta; ++j) {
        int* meta = meta_of(recs[j], L);
        if (lane == 0) meta[0] = t;
        if (lane < L.topk) {
          meta[1 + lane] = e;
          ((float*)meta)[1 + L.topk + lane] = w;
        }
      }
    }
    __syncthreads();
    if (puts) {
      put_block_all(remote, pes, puts, xd[nd], L.rec_bytes);
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
