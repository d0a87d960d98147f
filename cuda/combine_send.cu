// Combine, send half (expert side): send expert outputs back to the ranks of each token's DP group.
#include "alltoall.cuh"

using namespace moecomm;

// grid: world * parts blocks of MOECOMM_BLOCK_THREADS; block b serves the records received from rank
// b % world, one block per record (strided).
//   recv_buf        dispatch records (token index, weights) of the last dispatch
//   slot_of         [world, max_tokens, topk] int32 from dispatch_recv
//   y [local_experts, cap, hidden] out_dtype: expert outputs, laid out like dispatch's out_x
//   partials        1: sum a token's local experts weighted by the dispatched weights and send one row
//                   to comb_buf[me][token]; 0: send each expert's row to comb_buf[token][k]
//   comb_buf        symmetric [max(world, topk) * max_tokens, hidden] out_dtype on every rank
//   comb_sig        symmetric uint64 [world]: comb_sig[me] on each rank gets (epoch | 1) when done
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, 2)
    moecomm_combine_send(const long long* layout, unsigned* state, int* err, const uint8_t* recv_buf,
                         const int* slot_of, const uint8_t* y, int partials, uint8_t* comb_buf,
                         uint64_t* comb_sig, uint8_t* stage) {
  const Layout L(layout);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int src = blockIdx.x % L.world, part = blockIdx.x / L.world, parts = gridDim.x / L.world;
  const unsigned epoch = state[MOECOMM_S_EPOCH_CS] + 1;
  const unsigned count = state[L.s_recv + src];
  const int group0 = src / L.dp * L.dp, group1 = group0 + L.dp;  // the source's DP group
  __shared__ const uint8_t* rows[MOECOMM_MAX_TOPK];
  __shared__ float wts[MOECOMM_MAX_TOPK];
  __shared__ int ks[MOECOMM_MAX_TOPK];
  __shared__ int n, token;
  __shared__ uint8_t* dsts[MAX_FANOUT];
  __shared__ uint8_t* remote[MAX_FANOUT];
  __shared__ int pes[MAX_FANOUT];
  Targets tg{dsts, remote, pes};
  Stage st(stage, L);
  for (int j = part; j < (int)count; j += parts) {
    if (warp == 0) {  // this rank's experts of the record's token, compacted
      const uint8_t* rec = recv_buf + ((size_t)src * L.max_tokens + j) * L.rec_bytes;
      const int* meta = meta_of(rec, L);
      int s = -1;
      if (lane < L.topk) s = slot_of[((size_t)src * L.max_tokens + j) * L.topk + lane];
      const unsigned mask = __ballot_sync(FULL, s >= 0);
      if (s >= 0) {
        const int pos = __popc(mask & ((1u << lane) - 1));
        rows[pos] = y + (size_t)s * L.out_row_bytes;
        wts[pos] = ((const float*)meta)[1 + L.topk + lane];
        ks[pos] = lane;
      }
      if (lane == 0) {
        n = __popc(mask);
        token = meta[0];
      }
    }
    __syncthreads();
    const int t = token;
    // peers in batches of MOECOMM_MAX_TOPK (a DP group can be larger than the fan-out arrays)
    for (int q0 = group0; q0 < group1; q0 += MOECOMM_MAX_TOPK) {
      const int q1 = min(group1, q0 + MOECOMM_MAX_TOPK);
      if (partials) {
        tg.build(comb_buf + ((size_t)L.rank * L.max_tokens + t) * L.out_row_bytes, q0, q1, st);
        weighted_sum(rows, wts, n, L.out_row_bytes, L.out_code, tg.dsts, tg.n);
        tg.send_puts(L.out_row_bytes);
      } else {
        for (int k = 0; k < n; ++k) {
          tg.build(comb_buf + ((size_t)t * L.topk + ks[k]) * L.out_row_bytes, q0, q1, st);
          fanout16(tg.dsts, tg.n, rows[k], L.out_row_bytes, 0);
          tg.send_puts(L.out_row_bytes);
        }
      }
    }
    __syncthreads();  // rows, wts, n and token are rewritten for the next record
  }
  complete_sends(st.used_puts);
  if (last_block(&state[MOECOMM_S_DONE_CS])) {
    for (int q = threadIdx.x; q < L.world; q += blockDim.x)
      signal_set(&comb_sig[L.rank], epoch_signal(epoch, 1), q);
    __syncthreads();
    if (threadIdx.x == 0) {
      state[MOECOMM_S_DONE_CS] = 0;
      state[MOECOMM_S_EPOCH_CS] = epoch;
    }
  }
}
