// Combine, receive half (token side): wait for every expert rank, then sum each token's rows.
#include "alltoall.cuh"

using namespace moecomm;

// A lane, stream: wait (bounded) until expert rank q's partial sum for token t has landed: its arrival word
// holds the call, or q's signal, which follows all its rows, has come.
static __device__ __forceinline__ void row_landed(const Fixed& f, int q, int t, unsigned epoch, uint64_t deadline) {
  const uint64_t* word = &f.comb_arrive[(size_t)q * f.max_tokens + t];
  for (unsigned spin = 1; load_acquire(word) != epoch && (load_acquire(&f.comb_sig[q]) >> 32) < epoch; ++spin)
    if (give_up(spin, deadline, f.err, q, MOECOMM_PHASE_COMBINE, (int)epoch)) return;
}

// grid: any number of blocks of MOECOMM_BLOCK_THREADS; one block per token (strided, from the grid's last block
// down) over the group's m, after every expert rank's signal. `stream` (the one-launch combine's streamed
// form, combine.cu): blocks claim tokens one at a time (state[TOKENS_EVEN + epoch % 2], zeroed by combine_send
// a call ahead) and sum each as soon as the partial sums of its other expert ranks have landed (row_landed),
// with this rank's own expert rows read where they are (f.own_of: slots and weights from dispatch_send, as
// combine_send would have summed them); the signals are waited for after the tokens. No grid-wide
// completion: a block ends with its tokens.
// Reads f.comb_buf and f.comb_sig (this rank's copies), c.indices (c.idx64), c.weights [rows, topk]
// float32 (read when c.partials == 0), c.bound_m, c.rows; writes rows 0..m-1 of c.out_tokens
// [rows, hidden] out_dtype (a token whose ids are all -1 gets zeros) and, when given, of c.out_dropped
// [rows, topk] uint8 (1: the pair was dropped for capacity, from f.drop_buf; it adds nothing). Experts of
// masked ranks add nothing and masked ranks are not waited for. With c.skip, a bound_m other than the
// dispatched m (reported by combine_send) or a dispatch whose send half failed, nothing is written.
// Telemetry: bytes received per peer.
__device__ void moecomm::combine_recv(const Fixed& f, const Call& c, unsigned epoch, bool stream) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  TRACE(MOECOMM_TRACE_COMBINE_RECV, 0);
  const uint64_t deadline = now_ns() + f.timeout_ns;
  int m = c.skip ? 0 : *c.bound_m;
  if (m != (int)f.state[MOECOMM_S_M] || f.state[MOECOMM_S_M] == M_INVALID) {
    m = 0;  // dispatch_send or combine_send reported it
  } else if (m > c.rows) {
    if (blockIdx.x == 0 && threadIdx.x == 0)
      record_error(f.err, MOECOMM_ERR_BAD_M, f.rank, MOECOMM_PHASE_COMBINE, m, (int)epoch);
    m = 0;
  }
  __shared__ const uint8_t* srcs[MOECOMM_MAX_TOPK];  // comb_buf rows to add for the block's token
  __shared__ float wts[MOECOMM_MAX_TOPK];
  __shared__ int n;
  __shared__ uint8_t* dst;
  __shared__ int cur;
  const int first = gridDim.x - 1 - blockIdx.x;  // the grid's last blocks take the first tokens (as dispatch_recv)
  unsigned* const claims = &f.state[MOECOMM_S_TOKENS_EVEN + epoch % 2];
  int ahead = stream && threadIdx.x == 0 ? (int)atomicAdd(claims, 1u) : 0;  // stream: the next claim, in flight
  for (int t = first, i = 0;; t += gridDim.x, ++i) {  // t: warp 0's until the barrier below, then the block's
    if (stream && warp == 0) {
      t = __shfl_sync(FULL, ahead, 0);
      if (lane == 0) ahead = (int)atomicAdd(claims, 1u);
    }
    // warp 0: the token's rows, in lane registers (before the first wait: indices do not depend on it)
    bool use = false, valid = false;
    int rank = -1;
    int2 own = make_int2(-1, 0);  // stream: this rank's expert slot of the lane's id and its weight
    if (warp == 0 && t < m) {
      if (stream && lane < f.topk) own = f.own_of[(size_t)t * f.topk + lane];
      int e = -1;
      if (lane < f.topk) e = expert_id(c, (size_t)t * f.topk + lane, f.num_experts);
      valid = lane < f.topk && e >= 0 && e < f.num_experts;
      rank = valid ? physical(f, e, t) / f.local_experts : -1;
      valid = valid && !f.mask[rank];
      if (!valid) rank = -1;
      bool once = valid;
      for (int j = 0; j < f.topk; ++j) {
        const int rj = __shfl_sync(FULL, rank, j);
        if (j < lane) once = once && rj != rank;
      }
      use = c.partials ? once : valid;
      if (stream && rank == f.rank) use = own.x >= 0;  // the expert row itself (-1: dropped or over capacity)
    }
    if (stream && valid && rank != f.rank) row_landed(f, rank, t, epoch, deadline);  // it also reads drop words
    if (i == 0 && !stream) {  // every block waits for every expert rank once, even with no token of its own
      for (int q = threadIdx.x; q < f.world; q += blockDim.x)
        if (!f.mask[q])
          peer_failed(f, c, wait_epoch(&f.comb_sig[q], epoch, deadline, f.err, q, MOECOMM_PHASE_COMBINE), q,
                      MOECOMM_PHASE_COMBINE, epoch);
      if (f.drop_buf) __syncthreads();  // warp 0 reads drop words of ranks other warps waited for
      TRACE(MOECOMM_TRACE_COMBINE_RECV, 1);
    }
    if (warp == 0 && t < m) {
      bool dropped = false;  // written by the expert's rank before its combine signal
      if (f.drop_buf && valid) {
        const uint64_t d = load_acquire(&f.drop_buf[(size_t)rank * f.max_tokens + t]);
        dropped = (unsigned)(d >> 32) == epoch && ((d >> lane) & 1);
      }
      if (c.out_dropped && lane < f.topk) c.out_dropped[(size_t)t * f.topk + lane] = dropped;
      if (!c.partials && dropped) use = false;
      const unsigned mask = __ballot_sync(FULL, use);
      if (use) {
        const int pos = __popc(mask & ((1u << lane) - 1));
        const size_t row = c.partials ? (size_t)rank * f.max_tokens + t : (size_t)t * f.topk + lane;
        const bool mine = stream && rank == f.rank;
        srcs[pos] = mine ? c.y + (size_t)own.x * f.out_row_bytes : f.comb_buf + row * f.out_row_bytes;
        wts[pos] = mine ? __int_as_float(own.y) : c.partials ? 1.0f : c.weights[(size_t)t * f.topk + lane];
        if (rank != f.rank) tally_bytes(f, MOECOMM_B_COMBINE_RECEIVED, rank, f.out_row_bytes);
      }
      if (lane == 0) {
        n = __popc(mask);
        dst = c.out_tokens + (size_t)t * f.out_row_bytes;
      }
    }
    if (threadIdx.x == 0) cur = t;
    __syncthreads();
    t = cur;
    if (i == 0) TRACE(MOECOMM_TRACE_COMBINE_RECV, 2);
    if (t >= m) break;
    weighted_sum(srcs, wts, n, f.out_row_bytes, f.out_code, &dst, 1);
    __syncthreads();
    if (i == 0) TRACE(MOECOMM_TRACE_COMBINE_RECV, 3);
  }
  if (stream)  // the signals: a failed peer is reported, and every expert rank was heard from
    for (int q = threadIdx.x; q < f.world; q += blockDim.x)
      if (!f.mask[q])
        peer_failed(f, c, wait_epoch(&f.comb_sig[q], epoch, deadline, f.err, q, MOECOMM_PHASE_COMBINE), q,
                    MOECOMM_PHASE_COMBINE, epoch);
  TRACE(MOECOMM_TRACE_COMBINE_RECV, 4);
}

extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_combine_recv(const Fixed f, const Call c) {
  TRACE_SPAN(MOECOMM_TRACE_COMBINE_RECV, 0);
  combine_recv(f, c, f.state[MOECOMM_S_EPOCH_CS], false);  // the call combine_send (the previous kernel) ended
  TRACE_SPAN(MOECOMM_TRACE_COMBINE_RECV, 1);
}
