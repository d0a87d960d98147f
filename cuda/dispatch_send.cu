// Dispatch, send half: route this rank's share of the tokens to the ranks owning their experts.
#include "alltoall.cuh"

using namespace moecomm;

// grid: any number of blocks of MOECOMM_BLOCK_THREADS; the first `senders` of them take a token each
// (strided), the others only count themselves done (the one-launch kernel's receive-only blocks, dispatch.cu).
// Reads c.x, c.x_scale (or null), c.indices (c.idx64), c.weights (or null), c.bound_m, c.rows; writes
// c.out_x, c.out_scale and f.slot_of for this rank's own experts, records into f.recv_buf
// [world, max_tokens, rec_bytes] of the other ranks (row [me][slot]), and sets f.sig[me] on every rank
// to (epoch | flags | count). In the one-launch kernel with f.streamed (prefill-sized batches: some blocks
// only receive) a block follows the records it stored into mapped ranks by their arrival words there,
// f.arrive[me][slot] = epoch (Arrivals), and dispatch_recv unpacks those before the signal; the signal covers
// every record (puts to ranks without a mapping leave theirs to it). Small batches and the split kernel (its
// receive half starts after it) have no arrival words, so no fence is added to their path. With
// f.comb_streamed, f.own_of[t] also gets this rank's expert slots of token t and their weights, for the
// streamed combine's token side (combine_recv). With gradients (f.sent), f.sent[t] gets the physical expert
// each of token t's pairs went to (-1: not sent), for the routing plan (backward.cu). f.ids_of[t] gets the ids
// as read, which combine's must equal (IdsCheck).
// This rank sends the tokens t = dp_rank, dp_rank + dp, ... < m of its DP group, each once per other
// destination rank as a record (the receiver fans it out to its experts); tokens for this rank's own
// experts go straight into their expert slots, and only the record's metadata (for combine) is kept.
// The token row is read once and stored into every destination (with f.packed, this rank's own record
// takes the row like a peer's, rows placed by dispatch_recv's place_rows, but where the receive half runs in
// this launch (Whole): then it keeps the metadata only and place_rows reads the row from c.x). Expert id -1 sends
// nothing, nor does an expert of a masked rank (f.mask; counted in f.counters). With an expert map (f.map) ids
// are logical and each pair goes to one replica (physical(), passing over masked ranks); records carry
// physical ids. With tags (f.num_tags) a record's metadata also carries its token's tag, and the pairs this
// rank's own experts keep are counted per tag here (count_tag); with f.gap_ring each token's router
// confidence is counted (count_gap). A tag out of range fails the token like a bad id (ERR_BAD_TAG). A pair
// for this rank's own expert past its capacity is not stored: dropped (f.drop: flagged in f.drop_buf[me][t]
// for combine) or, with overflow="error", reported by dispatch_recv, which sees the expert's whole demand.
// With c.skip (a refused call) nothing is sent and every signal carries SIG_BAD | c.reason; otherwise a
// signal carries the count and the expert-map generation (state[GEN]).
template <bool Pipelined, bool Whole>
__device__ void moecomm::dispatch_send(const Fixed& f, const Call& c, int senders, bool local) {
  TRACE(MOECOMM_TRACE_DISPATCH_SEND, 0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned epoch = f.state[MOECOMM_S_EPOCH_DS] + 1;
  // Destinations of a token, in this order: records on mapped peers, the staged record (when some peer
  // needs a put), rows of this rank's experts. xd: where x goes, sd: where its scales go. recs: records that
  // get the metadata (mapped, staged, and this rank's own record, metadata only). Two lists: the pipelined
  // loop (below) routes a token into one while the other is sent; the plain loop uses list 0; where no row is
  // sent (sends_rows false) each warp routes tokens of its own into list `warp`.
  constexpr int LISTS = Whole ? THREADS / 32 : 2;
  __shared__ uint8_t* xd[LISTS][MAX_FANOUT];
  __shared__ uint8_t* sd[LISTS][MAX_FANOUT];
  __shared__ uint8_t* recs[LISTS][MAX_FANOUT];
  __shared__ uint8_t* remote[MAX_FANOUT];
  __shared__ int pes[MAX_FANOUT];
  __shared__ uint64_t* words[2][ARRIVAL_BATCH * MAX_FANOUT];  // arrival words of the block's mapped records
  __shared__ int n_direct[LISTS], n_put[LISTS], n_local[LISTS], n_meta[LISTS], tok[2];  // n_put < 0: skip the token
  // whether any token's row goes anywhere from here: not at world size 1 in a packed layout with the receive
  // half in this launch, where every record is the own, metadata only (place_rows reads the rows from c.x)
  const bool sends_rows = !(Whole && f.packed && f.world == 1);
  const bool routes = warp == 0 || !sends_rows;  // this warp routes tokens
  // a routing warp: a token's ids and weights (lane k: its k-th); the block's first token's are loaded at once,
  // beside bound_m and the epoch (any row < rows is readable; a skipped call has no rows)
  int e = -1;
  float w = 0.0f;
  int tag = -1;  // a routing warp (every lane): the token's tag (tag_of)
  auto load_ids = [&](int t) {
    e = -1;
    w = 0.0f;
    if (routes && lane < f.topk && t < c.rows) {
      e = expert_id(c, (size_t)t * f.topk + lane, f.num_experts);
      if (c.weights) w = c.weights[(size_t)t * f.topk + lane];
    }
    if (routes) tag = tag_of(f, c, t);
  };
  auto token = [&](int i) { return f.rank % f.dp + i * f.dp; };  // the block's tokens: i = blockIdx.x + k * senders
  load_ids((int)blockIdx.x < senders ? token(blockIdx.x) : c.rows);
  // a routing warp, lane q: whether rank q is masked (world <= 32: looked up by a shuffle, not a load per token)
  const bool mask_lanes = f.world <= 32;
  const int masked_lane = routes && mask_lanes && lane < f.world ? f.mask[lane] : 0;
  const int m = dispatch_begin(f, c, epoch);
  TRACE(MOECOMM_TRACE_DISPATCH_SEND, 1);
  const int lo = f.rank * f.local_experts;
  const uint8_t* x = c.x;
  Arrivals arr{words};
  const bool arrivals = f.streamed && senders < (int)gridDim.x;
  const bool own_of = (MOECOMM_STREAMS_COMBINE && f.comb_streamed) || f.world == 1;
  uint8_t* const recv_buf = f.recv_buf;
  // Pipelined (a block with a second token, no puts): warp 0 routes token i+1 into list b^1 and
  // writes its records' metadata while the other warps send token i from list b; with arrival words the last
  // warp only releases them (its fence off the copy). Otherwise a token at a time, its row in flight while
  // warp 0 routes it.
  const bool pipelined =
      Pipelined && !HAS_PUTS && sends_rows && (int)blockIdx.x < senders && token(blockIdx.x + senders) < m;
  // a routing warp: the metadata of token t into the records of list b
  auto write_meta = [&](int b, int t) {
    for (int j = 0; j < n_meta[b]; ++j) {
      int* meta = meta_of(recs[b][j], f);
      if (lane == 0) {
        meta[0] = t;
        if (f.num_tags) meta[1 + 2 * f.topk] = tag;  // the receiver counts the pairs its experts keep per tag
      }
      if (lane < f.topk) {
        meta[1 + lane] = e;
        ((float*)meta)[1 + f.topk + lane] = w;
      }
    }
  };
  // a routing warp (every lane): check token t's experts, take slots (in parallel lanes), list its destinations in
  // list b; pipelined, also write its records' metadata (no staged record then)
  auto route = [&](int t, int b) {
    int dest = -1, slot_id = -1;  // the pair's physical expert slot and its rank
    bool ok = true, first = false;
    if (lane < f.topk) {
      f.ids_of[(size_t)t * f.topk + lane] = e;  // combine checks its ids against these
      ok = e < f.num_experts;
      slot_id = ok && e >= 0 ? physical(f, e, t) : -1;
      dest = slot_id >= 0 ? slot_id / f.local_experts : -1;
    }
    const int dest_masked = mask_lanes ? __shfl_sync(FULL, masked_lane, dest & 31) : dest >= 0 && f.mask[dest];
    if (dest >= 0 && dest_masked) dest = -2;  // masked: not sent, counted below
    first = dest >= 0;
    const bool first_e = first_of(e), first_dest = first_of(dest);
    ok = ok && (e < 0 || first_e);  // repeated experts are invalid; repeated ranks are sent once
    first = first && first_dest;
    if (__any_sync(FULL, !ok)) {
      if (lane == 0) {
        record_error(f.err, MOECOMM_ERR_BAD_EXPERT, f.rank, MOECOMM_PHASE_DISPATCH, t, (int)epoch);
        atomicCAS(&f.state[MOECOMM_S_BAD], 0u, (unsigned)MOECOMM_ERR_BAD_EXPERT);
        n_put[b] = -1;
      }
      return;
    }
    if (!tag_ok(f, c, tag)) {  // the same in every lane
      if (lane == 0) {
        record_error(f.err, MOECOMM_ERR_BAD_TAG, f.rank, MOECOMM_PHASE_DISPATCH, t, (int)epoch, tag);
        atomicCAS(&f.state[MOECOMM_S_BAD], 0u, (unsigned)MOECOMM_REASON_BAD_TAG);
        n_put[b] = -1;
      }
      return;
    }
    if (f.gap_ring) count_gap(f, c, e, w, call_row(f));  // e: the token's logical ids (-1 past top-k), masked too
    const unsigned masked = __ballot_sync(FULL, dest == -2);
    if (lane == 0) tally(f, MOECOMM_C_MASKED_PAIRS, __popc(masked));
    e = dest >= 0 ? slot_id : -1;  // from here on: physical slots, -1 for pairs not sent
    // this rank's own experts: in the packed layouts a record (dispatch_recv places every row once the counts
    // are known), with the row but where the receive half runs in this launch (Whole); padded: their rows go
    // straight into their slots, and the own record keeps the metadata only
    const bool own_record = dest == f.rank && (!f.packed || Whole);  // metadata only
    const bool peer = first && !own_record, local = dest == f.rank && !f.packed;
    uint8_t* sym = nullptr;
    uint8_t* p = peer ? peer_ptr(f.peers, recv_buf, dest) : nullptr;  // resolved alongside the slot atomic
    // both slot atomics in flight before either result is used
    unsigned rec_slot = 0, slot = 0;
    if (first) rec_slot = atomicAdd(&f.state[MOECOMM_S_FIXED + dest], 1u);
    if (local) slot = atomicAdd(&f.state[f.s_expert + e - lo], 1u);
    size_t rec_off = 0;
    if (first) {
      rec_off = ((size_t)f.rank * f.max_tokens + rec_slot) * f.rec_bytes;
      sym = recv_buf + rec_off;
    }
    int where = -1;  // this rank's expert slot of the lane's expert
    bool dropped = false;
    if (local) {
      if (slot < (unsigned)f.cap) where = (e - lo) * f.cap + slot;
      else dropped = f.drop;
      if (where >= 0 && f.tag_ring) count_tag(f, tag, e - lo, call_row(f));
    }
    const unsigned drops = __ballot_sync(FULL, dropped);
    if (drops && lane == 0)  // read by this rank's combine_recv after the call's combine signals
      f.drop_buf[(size_t)f.rank * f.max_tokens + t] = epoch_signal(epoch, drops);
    if (p) p += rec_off;
    const unsigned direct = __ballot_sync(FULL, p != nullptr), put = __ballot_sync(FULL, peer && !p);
    const unsigned rows_here = __ballot_sync(FULL, where >= 0), own = __ballot_sync(FULL, first && own_record);
    const unsigned below = (1u << lane) - 1;
    const int nd = __popc(direct), staged = put ? 1 : 0;
    if (p) {
      xd[b][__popc(direct & below)] = p;
      sd[b][__popc(direct & below)] = p + f.x_bytes;
      recs[b][__popc(direct & below)] = p;
      if (arrivals)
        arr.word(__popc(direct & below)) =
            peer_ptr(f.peers, f.arrive + (size_t)f.rank * f.max_tokens + rec_slot, dest);
    }
    if (peer && !p) {
      remote[__popc(put & below)] = sym;
      pes[__popc(put & below)] = dest;
    }
    if (where >= 0) {
      const int pos = nd + staged + __popc(rows_here & below);
      xd[b][pos] = c.out_x + (size_t)where * f.x_bytes;
      sd[b][pos] = scale_row(f, c, where);
    }
    if (own) {  // this rank's record: metadata (for combine; packed: for the receive half, which routes it)
      const uint8_t* mine = (const uint8_t*)__shfl_sync(FULL, (unsigned long long)sym, __ffs(own) - 1);
      if (lane < f.topk && !(Whole && f.packed)) f.slot_of[(mine - recv_buf) / f.rec_bytes * f.topk + lane] = where;
      if (lane == 0) recs[b][nd + staged] = (uint8_t*)mine;
    }
    if (own_of && lane < f.topk) f.own_of[(size_t)t * f.topk + lane] = make_int2(where, __float_as_int(w));
    if (f.sent && lane < f.topk) f.sent[(size_t)t * f.topk + lane] = e;  // the routing plan's (backward.cu)
    if (lane == 0) {
      n_direct[b] = nd;
      n_put[b] = __popc(put);
      n_local[b] = __popc(rows_here);
      n_meta[b] = nd + staged + (own ? 1 : 0);
    }
    if (pipelined) {
      __syncwarp();
      write_meta(b, t);
      if (arrivals) arr.stored(nd);  // warp 0's count of listed words runs a token ahead of the block's
    }
  };
  // warp 0: route token i (its ids loaded here, but for the block's first) into list b; tok[b] = -1: none
  auto next = [&](int i, int b) {
    const int t = token(i);
    if (lane == 0) tok[b] = t < m ? t : -1;
    if (t >= m) return;
    if (i != (int)blockIdx.x) load_ids(t);
    route(t, b);
  };
  constexpr int copiers = THREADS - 64;  // pipelined: warps 1..6 send (the last one releases arrival words)
  Stage st(f);
  // Pipelined, round k sends the token routed in round k-1 (list b = k & 1) while warp 0 routes the next
  // into list b^1; round -1 only routes the block's first. Otherwise round k routes and sends its token in
  // list 0.
  const int k0 = pipelined ? -1 : 0;
  for (int i = blockIdx.x * LISTS + warp; !sends_rows && (int)blockIdx.x < senders; i += senders * LISTS) {
    const int t = token(i);  // no row is sent: each warp routes tokens of its own and writes their metadata
    if (t >= m) break;
    load_ids(t);
    route(t, warp);
    __syncwarp();
    if (n_put[warp] >= 0) write_meta(warp, t);
    __syncwarp();  // list `warp` is rewritten for the warp's next token
  }
  for (int k = k0; sends_rows && (int)blockIdx.x < senders; ++k) {
    const int i = blockIdx.x + k * senders, b = k & 1;
    // list b is read before this round's barrier only: warp 0 refills it in the next round
    const int t = !pipelined ? token(i) : k < 0 ? 0 : tok[b];
    if (t < 0 || t >= m) break;
    const uint8_t* const xt = x + (size_t)t * source_row_bytes(f);
    const uint8_t* const scales = c.x_scale + (size_t)t * f.scale_bytes;
    const bool ahead = pipelined && k >= 0 && n_put[b] >= 0;  // pipelined: a valid token to send
    const int ahead_nd = ahead ? n_direct[b] : 0;
    RowCopy row(f.quant != 0);
    if (!pipelined) row.load(f, xt, scales);  // the token row and scales, in flight while warp 0 routes the token
    arr.release_pending(epoch);
    if (warp == 0) {
      next(pipelined ? i + senders : i, pipelined ? b ^ 1 : 0);
    } else if (ahead && (!Whole || ahead_nd + n_local[b] > 0) && (int)threadIdx.x - 32 < copiers) {  // a row to send
      row.load(f, xt, scales, threadIdx.x - 32, copiers);
      row.store(f, xd[b], sd[b], ahead_nd + n_local[b], ahead_nd, xt, scales, threadIdx.x - 32, copiers);
    }
    __syncthreads();
    if (k == k0) TRACE(MOECOMM_TRACE_DISPATCH_SEND, 2);
    if (pipelined) {
      if (arrivals && ahead && warp != 0) arr.stored(ahead_nd);
      if (k == 0) TRACE(MOECOMM_TRACE_DISPATCH_SEND, 3);
      continue;
    }
    if (n_put[0] < 0) {  // invalid token: nothing sent
      __syncthreads();
      continue;
    }
    const int puts = n_put[0], nd = n_direct[0];
    if (puts) {  // one staged record, put to every destination without a mapping
      uint8_t* staged = st.next();
      if (threadIdx.x == 0) {
        xd[0][nd] = recs[0][nd] = staged;
        sd[0][nd] = staged + f.x_bytes;
      }
      __syncthreads();
    }
    row.store(f, xd[0], sd[0], nd + (puts ? 1 : 0) + n_local[0], nd + (puts ? 1 : 0), xt, scales);
    if (warp == 0) write_meta(0, t);
    __syncthreads();
    if (arrivals) arr.stored(nd);
    if (puts) {
      put_block_all(remote, pes, puts, xd[0][nd], f.rec_bytes);
      __syncthreads();
    }
    if (k == 0) TRACE(MOECOMM_TRACE_DISPATCH_SEND, 3);
  }
  arr.release_last(epoch);
  TRACE(MOECOMM_TRACE_DISPATCH_SEND, 4);
  if (st.used_puts) quiet();
  const bool is_last = last_block(&f.state[MOECOMM_S_DONE_DS], f.world > 1);  // alone, stores stay on this GPU
  TRACE(MOECOMM_TRACE_DISPATCH_SEND, 5);
  if (is_last) dispatch_sent(f, c, epoch, local, -1);
}

extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_dispatch_send(const Fixed f, const Call c) {
  after_previous_kernel();
  TRACE_SPAN(MOECOMM_TRACE_DISPATCH_SEND, 0);
  dispatch_send<false>(f, c, gridDim.x);
  TRACE_SPAN(MOECOMM_TRACE_DISPATCH_SEND, 1);
}
template __device__ void moecomm::dispatch_send<false>(const Fixed&, const Call&, int, bool);
template __device__ void moecomm::dispatch_send<true>(const Fixed&, const Call&, int, bool);
template __device__ void moecomm::dispatch_send<false, true>(const Fixed&, const Call&, int, bool);
template __device__ void moecomm::dispatch_send<true, true>(const Fixed&, const Call&, int, bool);
