// Combine, receive half (token side): wait for every expert rank, then sum each token's rows.
#include "alltoall.cuh"

using namespace moecomm;

// A lane, stream: wait (bounded) until expert rank q's partial sum for token t has landed: its arrival word
// holds the call, or q's signal, which follows all its rows, has come.
static __device__ __forceinline__ void row_landed(const Fixed& f, int q, int t, unsigned epoch, uint64_t deadline) {
  const uint64_t* word = &f.comb_arrive[(size_t)q * f.max_tokens + t];
  for (unsigned spin = 1; load_acquire(word) != epoch && (load_acquire(&f.comb_sig[q]) >> 32) < epoch; ++spin)
    if (give_up(spin, deadline, f.err, f.gone, q, MOECOMM_PHASE_COMBINE, (int)epoch)) return;
}

// Warp 0 (every lane), token t < m: the rank of the lane's expert (lane < topk; -1 where none: id -1, an
// invalid id, or a masked rank) and in `use` whether the lane adds a row: with partial sums, the first lane
// of each rank; without, every valid lane. `stream`: this rank's own experts add their rows themselves
// (`own`: slot and weight bits from dispatch_send, slot -1 when dropped or over capacity).
static __device__ __forceinline__ int token_ranks(const Fixed& f, const Call& c, int t, bool stream, bool& use,
                                                  int2& own) {
  const int lane = threadIdx.x & 31;
  own = make_int2(-1, 0);
  if (stream && lane < f.topk) own = f.own_of[(size_t)t * f.topk + lane];
  const int e = lane < f.topk ? expert_id(c, (size_t)t * f.topk + lane, f.num_experts) : -1;
  bool valid = lane < f.topk && e >= 0 && e < f.num_experts;
  int rank = valid ? physical(f, e, t) / f.local_experts : -1;
  valid = valid && !f.mask[rank];
  if (!valid) rank = -1;
  const bool once = first_of(rank) && valid;
  use = c.partials ? once : valid;
  if (stream && rank == f.rank) use = own.x >= 0;
  return rank;
}

// Warp 0 (every lane), token t < m, once the rows of its expert ranks are there (signals, or stream: arrival
// words): list the rows to add and their weights in srcs / wts (compacted), *n and *dst (lane 0); writes the
// token's c.out_dropped (a pair dropped for capacity, from f.drop_buf, which the expert's rank wrote before its
// rows' completion, adds nothing).
static __device__ __forceinline__ void token_rows(const Fixed& f, const Call& c, int t, unsigned epoch, int rank,
                                                  bool use, int2 own, bool stream, const uint8_t** srcs, float* wts,
                                                  int* n, uint8_t** dst) {
  const int lane = threadIdx.x & 31;
  bool dropped = false;
  if (f.drop_buf && rank >= 0) {
    const uint64_t d = load_acquire(&f.drop_buf[(size_t)rank * f.max_tokens + t]);
    dropped = (unsigned)(d >> 32) == epoch && ((d >> lane) & 1);
  }
  if (c.out_dropped && lane < f.topk && f.packed != MOECOMM_PACK_RANKS)  // (the ranks layout's: its out_weights)
    c.out_dropped[(size_t)t * f.topk + lane] = dropped;
  if (!c.partials && dropped) use = false;
  const unsigned mask = __ballot_sync(FULL, use);
  if (use) {
    const int pos = __popc(mask & ((1u << lane) - 1));
    const size_t row = c.partials ? (size_t)rank * f.max_tokens + t : (size_t)t * f.topk + lane;
    const bool mine = stream && rank == f.rank;
    srcs[pos] = mine ? c.y + (size_t)own.x * f.out_row_bytes : f.comb_buf + row * f.comb_row_bytes;
    wts[pos] = mine ? __int_as_float(own.y) : c.partials ? 1.0f : c.weights[(size_t)t * f.topk + lane];
    if (rank != f.rank) tally_bytes(f, MOECOMM_B_COMBINE_RECEIVED, rank, f.comb_row_bytes);
  }
  if (lane == 0) {
    *n = __popc(mask);
    *dst = c.out_tokens + (size_t)t * f.out_row_bytes;
  }
}

// grid: any number of blocks of MOECOMM_BLOCK_THREADS; one block per token (strided, from the grid's last block
// down) over the group's m, after every expert rank's signal. `stream` (the one-launch combine's streamed
// form, combine.cu): blocks claim tokens one at a time (state[TOKENS_EVEN + epoch % 2], zeroed by combine_send
// a call ahead) and sum each as soon as the partial sums of its other expert ranks have landed (row_landed),
// with this rank's own expert rows read where they are (f.own_of: slots and weights from dispatch_send, as
// combine_send would have summed them); the signals are waited for after the tokens. No grid-wide
// completion: a block ends with its tokens. Either way warp 0 lists a token's rows (two lists in turn) while
// the block's other warps sum the one before.
// Reads f.comb_buf (rows in out_dtype, or on the FP8 combine wire: f.wire, never streamed) and f.comb_sig
// (this rank's copies), c.indices (c.idx64), c.weights [rows, topk]
// float32 (read when c.partials == 0), c.bound_m, c.rows; writes rows 0..m-1 of c.out_tokens
// [rows, hidden] out_dtype (a token whose ids are all -1 gets zeros) and, when given, of c.out_dropped
// [rows, topk] uint8 (1: the pair was dropped for capacity, from f.drop_buf; it adds nothing), and with
// c.zero_tail zeros in the rest of c.out_tokens' rows (fill_rows). Experts of
// masked ranks add nothing and masked ranks are not waited for. With c.skip, a bound_m other than the
// dispatched m or above c.rows (both reported by combine_send) or a dispatch whose send half failed, no sum
// is written; there, and where an expert rank flagged its part failed or was not heard from (not streamed:
// the streamed form has summed its tokens by then), every row is NaN with c.nan_failed (fill_rows).
// Telemetry: bytes received per peer.
template <bool Wire>
__device__ void moecomm::combine_recv(const Fixed& f, const Call& c, unsigned epoch, bool stream) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  TRACE(MOECOMM_TRACE_COMBINE_RECV, 0);
  const uint64_t deadline = now_ns() + f.timeout_ns;
  int m = c.skip ? 0 : *c.bound_m;
  const bool own_failed = !c.skip && (m != (int)f.state[MOECOMM_S_M] || f.state[MOECOMM_S_M] == M_INVALID
      || !m_in_range(m, c.rows, f.max_tokens)
      || f.state[MOECOMM_S_EPOCH_DS] != epoch);  // a combine with no dispatch of its own (ERR_ORDER): nothing
  if (own_failed) m = 0;  // dispatch_send or combine_send reported it (to every rank)
  if (stream) fill_rows(f, c, m, own_failed);  // the sums stream: the other rows first
  __shared__ const uint8_t* srcs[2][MOECOMM_MAX_TOPK];  // two lists of rows to add (comb_buf, or expert_y)
  __shared__ float wts[2][MOECOMM_MAX_TOPK];
  __shared__ int n[2], cur[2];
  __shared__ uint8_t* dst[2];
  unsigned* const claims = &f.state[MOECOMM_S_TOKENS_EVEN + epoch % 2];
  // the ranks layout with out_weights (in c.out_dropped, a field it leaves free): each token's side rows summed
  const bool side = f.packed == MOECOMM_PACK_RANKS && c.out_dropped;
  int ahead = stream && threadIdx.x == 0 ? (int)atomicAdd(claims, 1u) : 0;  // stream: the next claim, in flight
  int next = gridDim.x - 1 - blockIdx.x;  // else: the grid's last blocks take the first tokens (as dispatch_recv)
  bool use = false;
  int2 own;
  int rank = -1;
  auto claim = [&](int b) {  // warp 0: the next token, into cur[b]
    const int t = stream ? __shfl_sync(FULL, ahead, 0) : next;
    next += gridDim.x;
    if (lane == 0) {
      if (stream) ahead = (int)atomicAdd(claims, 1u);
      cur[b] = t;
    }
    return t;
  };
  auto list = [&](int t, int b) {  // warp 0, after token_ranks: wait for the token's rows, list them in list b
    if (stream && rank >= 0 && rank != f.rank) row_landed(f, rank, t, epoch, deadline);  // before its drop words
    token_rows(f, c, t, epoch, rank, use, own, stream, srcs[b], wts[b], &n[b], &dst[b]);
  };
  auto signals = [&]() {  // every expert rank's signal (a thread per rank); a failed peer is reported, and one
                         // whose combine disagrees on the router weights (its rows are not what this rank sums).
                         // True where one of the thread's ranks flagged its part failed or was not heard from
    bool bad = false;
    for (int q = threadIdx.x; q < f.world; q += blockDim.x) {
      if (f.mask[q]) continue;
      const uint64_t v = wait_epoch(f, &f.comb_sig[q], epoch, deadline, q, MOECOMM_PHASE_COMBINE);
      bad |= !v || (v & SIG_BAD);
      peer_failed(f, c, v, q, MOECOMM_PHASE_COMBINE, epoch);
      const unsigned theirs = (unsigned)(v >> 1) & 1u;
      if (v && !(v & SIG_BAD) && !c.skip && theirs != (unsigned)c.partials)
        record_error(f.err, MOECOMM_ERR_WEIGHTS_DIFFER, q, MOECOMM_PHASE_COMBINE, (int)!theirs, (int)epoch);
    }
    return bad;
  };
  int t = warp == 0 ? claim(0) : 0;
  if (warp == 0 && t < m) rank = token_ranks(f, c, t, stream, use, own);  // before the wait: ids do not depend on it
  if (!stream) {  // every block waits for every expert rank, even with no token of its own (and so every block
                  // sees a failed rank's flag: the call's rows are all NaN or none are, c.nan_failed)
    const bool failed = __syncthreads_or(signals()) || own_failed;  // warp 0 reads drop words others waited for
    if (failed) m = 0;
    fill_rows(f, c, m, failed);
    TRACE(MOECOMM_TRACE_COMBINE_RECV, 1);
  }
  if (warp == 0 && t < m) list(t, 0);
  __syncthreads();
  TRACE(MOECOMM_TRACE_COMBINE_RECV, 2);
  // warp 0 claims and lists the next token (its loads, its wait for the peers' rows) while the other warps
  // sum the current one
  for (int i = 0; cur[i & 1] < m; ++i) {
    const int b = i & 1;
    if (warp == 0) {
      t = claim(b ^ 1);
      if (t < m) {
        rank = token_ranks(f, c, t, stream, use, own);
        list(t, b ^ 1);
      }
    } else {
      weighted_sum<Wire, false>(f, srcs[b], wts[b], n[b], &dst[b], 1, threadIdx.x - 32, THREADS - 32);
      const int k = threadIdx.x - 32;
      if (side && k < f.topk) {  // the ranks layout's side rows, summed over the token's ranks in float32
        float sum = 0.0f;
        for (int j = 0; j < n[b]; ++j) sum += side_row(srcs[b][j], f)[k];
        reinterpret_cast<float*>(c.out_dropped)[(size_t)cur[b] * f.topk + k] = sum;
      }
    }
    __syncthreads();
    if (i == 0) TRACE(MOECOMM_TRACE_COMBINE_RECV, 3);
  }
  if (stream) signals();  // after the tokens: every expert rank was heard from
  TRACE(MOECOMM_TRACE_COMBINE_RECV, 4);
}

// Both wait for the call that combine_send (the previous kernel) ended.
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_combine_recv(const Fixed f, const Call c) {
  after_previous_kernel();
  TRACE_SPAN(MOECOMM_TRACE_COMBINE_RECV, 0);
  combine_recv<false>(f, c, f.state[MOECOMM_S_EPOCH_CS], false);
  TRACE_SPAN(MOECOMM_TRACE_COMBINE_RECV, 1);
}

extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_combine_recv_wire(const Fixed f, const Call c) {
  after_previous_kernel();
  TRACE_SPAN(MOECOMM_TRACE_COMBINE_RECV, 0);
  combine_recv<true>(f, c, f.state[MOECOMM_S_EPOCH_CS], false);
  TRACE_SPAN(MOECOMM_TRACE_COMBINE_RECV, 1);
}
template __device__ void moecomm::combine_recv<false>(const Fixed&, const Call&, unsigned, bool);
template __device__ void moecomm::combine_recv<true>(const Fixed&, const Call&, unsigned, bool);
