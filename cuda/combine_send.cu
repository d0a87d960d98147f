// Combine, send half (expert side): send expert outputs back to the ranks of each token's DP group.
#include "alltoall.cuh"

using namespace moecomm;

static __device__ const float ONE = 1.0f;  // an expert row's weight when it travels alone

// grid: world * parts blocks of MOECOMM_BLOCK_THREADS; block b serves the records received from rank
// b % world, one block per record (strided). `stream` (the one-launch combine's streamed form, combine.cu):
// this rank's own records are not summed here (the token side reads their expert rows itself), so their
// blocks go straight on to the token side, and the partial sums stored into mapped ranks are followed by
// arrival words there, f.comb_arrive[me][token] = epoch (Arrivals); the signal still covers every row.
// Reads f.recv_buf (the last dispatch's records: token index, weights), f.slot_of, c.y [local_experts,
// cap, hidden] out_dtype (expert outputs, laid out like dispatch's out_x) and c.partials:
//   1: sum a token's local experts weighted by the dispatched weights and send one row to
//      f.comb_buf[me][token]; 0: send each expert's row to f.comb_buf[token][k].
// Rows travel in out_dtype, or with f.wire quantised to the FP8 combine wire (weighted_sum), f.comb_row_bytes
// each.
// Sets f.comb_sig[me] on every unmasked rank to combine_signal() when done (with c.partials), or to (epoch |
// SIG_BAD | reason) when this rank's part failed: its expert ids differ from its dispatch's (IdsCheck; its
// rows were sent; REASON_IDS_DIFFER, recorded here too), its dispatch failed (ERR_ENDED: bad routing or m,
// which dispatch reported to every rank), or it sends nothing: c.skip (a refused call; reason
// c.reason), a bound_m that differs from
// the dispatched m (ERR_M_DIFFERS, recorded here too) or exceeds c.rows, the fewest rows of the call's
// per-token arrays (ERR_BAD_M, recorded here too: its token side would not have rows for the sums), or a
// dispatch whose receive half failed (state[BAD_RECV]: capacity exceeded, the demand written to every peer's
// f.why[me] first).
// Telemetry: bytes sent per peer. Returns the call number (the epoch its signals carry).
template <bool Wire>
__device__ unsigned moecomm::combine_send(const Fixed& f, const Call& c, bool stream) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  TRACE(MOECOMM_TRACE_COMBINE_SEND, 0);
  const int src = blockIdx.x % f.world, part = blockIdx.x / f.world, parts = gridDim.x / f.world;
  const unsigned epoch = f.state[MOECOMM_S_EPOCH_CS] + 1;
  if (f.packed == MOECOMM_PACK_RANKS && part == 0)  // the ranks layout: the next dispatch's token bits
    for (int w = threadIdx.x; w < present_words(f); w += blockDim.x) present(f, src)[w] = 0;
  const bool side = f.packed == MOECOMM_PACK_RANKS && c.weights;  // expert_weights given: side rows travel
  IdsCheck ids(f, c);
  const CombineCheck check = combine_check(f, c, epoch);
  const unsigned bad_recv = check.bad_recv, reason = check.reason;
  // the records received from src, loaded beside the reason, not after it: dispatch_recv kept the count, or,
  // for this rank's own records in the padded layout (their rows placed by dispatch_send), the own signal of
  // this call's dispatch holds it (there already: the wait is bounded only because a put may carry it; none
  // where this rank sends nothing, whose dispatch may not have run: ERR_ORDER)
  const bool own = src == f.rank;
  const unsigned received = own && (stream || c.skip || reason) ? 0
      : own && !f.packed
      ? own_count(wait_epoch(f, &f.sig[f.rank], epoch, now_ns() + f.timeout_ns, f.rank, MOECOMM_PHASE_COMBINE))
      : f.state[f.s_recv + src];
  const unsigned count = c.skip || reason ? 0 : received;
  unsigned long long rows_sent = 0;  // per rank of the source's DP group (thread 0's tally)
  const int group0 = src / f.dp * f.dp, group1 = group0 + f.dp;  // the source's DP group
  __shared__ const uint8_t* rows[MOECOMM_MAX_TOPK];
  __shared__ float wts[MOECOMM_MAX_TOPK];
  __shared__ int ks[MOECOMM_MAX_TOPK];
  __shared__ int n, token, row0;  // row0: the ranks layout's record row (its side row's)
  __shared__ uint8_t* dsts[MAX_FANOUT];
  __shared__ uint8_t* remote[MAX_FANOUT];
  __shared__ int pes[MAX_FANOUT];
  __shared__ uint64_t* words[2][ARRIVAL_BATCH * MAX_FANOUT];  // stream: arrival words of the partial sums
  Targets tg{dsts, remote, pes};
  Arrivals arr{words};
  // stream (DP size 1: the source is the row's only destination): a word per row where src is mapped
  uint64_t* const arrive = stream ? peer_ptr(f.peers, f.comb_arrive + (size_t)f.rank * f.max_tokens, src) : nullptr;
  Stage st(f);
  int s = -1, tok = 0;  // warp 0: a record's expert slots (lane k: its k-th), weights and token
  float wt = 0.0f;
  auto load_record = [&](int j) {
    const size_t r = (size_t)src * f.max_tokens + j;
    const int* meta = meta_of(f.recv_buf + r * f.rec_bytes, f);
    s = lane < f.topk ? f.slot_of[r * f.topk + lane] : -1;  // the ranks layout: lane 0's, the record's row,
    wt = f.packed == MOECOMM_PACK_RANKS ? 1.0f      // which is its experts' weighted sum already
        : lane < f.topk ? ((const float*)meta)[1 + f.topk + lane] : 0.0f;
    tok = meta[0];
  };
  // the first record beside the count (any record < max_tokens is readable), then each next one while the
  // block sends the current one
  if (warp == 0) load_record(part);
  for (int j = part; j < (int)count; j += parts) {
    arr.release_pending(epoch);
    if (warp == 0) {  // this rank's experts of the record's token, compacted
      const unsigned mask = __ballot_sync(FULL, s >= 0);
      if (s >= 0) {
        const int pos = __popc(mask & ((1u << lane) - 1));
        rows[pos] = c.y + (size_t)s * f.out_row_bytes;
        wts[pos] = wt;
        ks[pos] = lane;
      }
      if (lane == 0) {
        n = __popc(mask);
        token = tok;
        row0 = s;
        if (arrive) arr.word(0) = arrive + tok;
      }
      if (j + parts < (int)count) load_record(j + parts);
    }
    __syncthreads();
    if (j == part) TRACE(MOECOMM_TRACE_COMBINE_SEND, 1);
    const int t = token;
    rows_sent += c.partials ? 1 : n;
    // peers in batches of MOECOMM_MAX_TOPK (a DP group can be larger than the fan-out arrays)
    for (int q0 = group0; q0 < group1; q0 += MOECOMM_MAX_TOPK) {
      const int q1 = min(group1, q0 + MOECOMM_MAX_TOPK);
      if (c.partials) {
        tg.build(f.peers, f.comb_buf + ((size_t)f.rank * f.max_tokens + t) * f.comb_row_bytes, q0, q1, st);
        weighted_sum<false, Wire>(f, rows, wts, n, tg.dsts, tg.n);
        if (side && threadIdx.x < f.topk)  // the ranks layout's side row after it (row0 >= 0: every record has one)
          for (int d = 0; d < tg.n; ++d) side_row(tg.dsts[d], f)[threadIdx.x] = c.weights[(size_t)row0 * f.topk +
                                                                                           threadIdx.x];
        tg.send_puts(f.comb_row_bytes);
      } else {
        for (int k = 0; k < n; ++k) {
          tg.build(f.peers, f.comb_buf + ((size_t)t * f.topk + ks[k]) * f.comb_row_bytes, q0, q1, st);
          if (Wire) weighted_sum<false, true>(f, &rows[k], &ONE, 1, tg.dsts, tg.n);  // the row, quantised
          else fanout16(tg.dsts, tg.n, rows[k], f.out_row_bytes);
          tg.send_puts(f.comb_row_bytes);
        }
      }
    }
    __syncthreads();  // rows, wts, n and token are rewritten for the next record
    if (arrive) arr.stored(1);
    if (j == part) TRACE(MOECOMM_TRACE_COMBINE_SEND, 2);
  }
  arr.release_last(epoch);
  TRACE(MOECOMM_TRACE_COMBINE_SEND, 3);
  if (st.used_puts) quiet();
  if (threadIdx.x == 0)
    for (int q = group0; q < group1; ++q)
      if (q != f.rank) tally_bytes(f, MOECOMM_B_COMBINE_SENT, q, rows_sent * f.comb_row_bytes);
  bool any_differ;  // the last block's: some block found other ids (its count flagged it)
  const bool is_last = last_block(&f.state[MOECOMM_S_DONE_CS], true, ids.differ(f, c, check.m), &any_differ);
  TRACE(MOECOMM_TRACE_COMBINE_SEND, 4);
  if (is_last) {
    TRACE_LAST_START();
    // other ids than the dispatch's: this rank's error, and its signals flag it (its rows were sent); so does a
    // dispatch of this rank that failed (its routing or m, reported to every rank then: ERR_ENDED here), so that
    // no peer's token side sums the call's rows as if it were right (they fill NaN with c.nan_failed)
    const bool ids_differ = !reason && any_differ;
    const unsigned flag = reason ? reason : ids_differ ? (unsigned)MOECOMM_REASON_IDS_DIFFER
        : check.failed ? (unsigned)MOECOMM_ERR_ENDED : 0u;
    if (ids_differ && threadIdx.x == 0)
      record_error(f.err, MOECOMM_ERR_IDS_DIFFER, f.rank, MOECOMM_PHASE_COMBINE, 0, (int)epoch);
    for (int q = threadIdx.x; q < f.world; q += blockDim.x) {
      if (f.mask[q]) continue;
      if (reason == bad_recv && bad_recv) signal_set(f.peers, &f.why[f.rank], f.state[MOECOMM_S_WHY], q);
      signal_set(f.peers, &f.comb_sig[f.rank], combine_signal(epoch, c, flag), q);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      f.state[MOECOMM_S_DONE_CS] = 0;
      f.state[MOECOMM_S_EPOCH_CS] = epoch;
    }
    TRACE_LAST(MOECOMM_TRACE_COMBINE_SEND);
  }
  return epoch;
}

extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_combine_send(const Fixed f, const Call c) {
  after_previous_kernel();
  TRACE_SPAN(MOECOMM_TRACE_COMBINE_SEND, 0);
  combine_send<false>(f, c, false);
  TRACE_SPAN(MOECOMM_TRACE_COMBINE_SEND, 1);
}

extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_combine_send_wire(const Fixed f, const Call c) {
  after_previous_kernel();
  TRACE_SPAN(MOECOMM_TRACE_COMBINE_SEND, 0);
  combine_send<true>(f, c, false);
  TRACE_SPAN(MOECOMM_TRACE_COMBINE_SEND, 1);
}
template __device__ unsigned moecomm::combine_send<false>(const Fixed&, const Call&, bool);
template __device__ unsigned moecomm::combine_send<true>(const Fixed&, const Call&, bool);
