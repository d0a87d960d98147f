// The local path: dispatch and combine at world size 1 in the padded layout, where every pair is this rank's
// own, so nothing is exchanged and no block waits for another (moecomm/transport/gpu_plan.py: local).
#include "alltoall.cuh"

using namespace moecomm;

namespace {

// The sources a dispatch call writes (moecomm.AllToAll.dispatch(sources=...)), carried in the dispatch record's
// combine-only fields (moecomm/_abi.py: CALL_FIELDS); src_info null where the call gives none.
__device__ __forceinline__ Sources call_sources(const Call& c) {
  Sources s;
  s.src_info = (int*)c.y;
  s.layout_range = (long long*)c.out_tokens;
  s.add_counts = (int*)c.out_dropped;
  return s;
}

// This block's share of s.src_info [local_experts * cap] set to -1 (an empty slot), by its warps but warp 0
// (which routes the block's token meanwhile): slots [b * per, (b + 1) * per) of block b.
__device__ __forceinline__ void fill_sources(const Fixed& f, const Sources& s) {
  const int slots = f.local_experts * f.cap, per = (slots + gridDim.x - 1) / gridDim.x;
  const int end = min(slots, ((int)blockIdx.x + 1) * per);
  for (int i = blockIdx.x * per + threadIdx.x - 32; i < end; i += blockDim.x - 32) s.src_info[i] = -1;
}

// What moecomm_source_layout (backward.cu) writes after this dispatch, at world size 1, by the last block once
// dispatch_sent has stored the counts (every thread, after a barrier): record t is token t (as many as the
// signal counts: none where the call failed), so each of its slots gets t; the one source's range in expert e
// starts at slot 0 and holds c.out_num[e] slots; s.add_counts (or null) gains them. The other slots are -1
// already (fill_sources, every block before it counted itself done).
__device__ __forceinline__ void local_sources(const Fixed& f, const Call& c, const Sources& s) {
  const int own = (int)own_count(f.sig[f.rank]), slots = f.local_experts * f.cap;
  for (int p = threadIdx.x; p < own * f.topk; p += blockDim.x) {
    const int slot = f.slot_of[p];
    if (slot >= 0 && slot < slots) s.src_info[slot] = p / f.topk;
  }
  for (int e = threadIdx.x; e < f.local_experts; e += blockDim.x) {
    const int n = own ? c.out_num[e] : 0;
    s.layout_range[e] = n;  // (first slot 0 << 32) | n
    if (s.add_counts) s.add_counts[e] += n;
  }
}

}  // namespace

// grid: f.max_tokens * parts blocks (gpu_plan.py: whole_kernels, small batches; _token_part_blocks: parts
// up to top-k while half the resident grid has room, 1 where pairs may be dropped for capacity, whose drop word
// is the token's). Block b takes token t = b / parts and its pairs k with k % parts == b % parts, so that a small
// batch's rows are stored from many SMs: its threads load the token's row and scales (RowCopy) while warp 0
// reads all the token's ids and weights, checks them (a repeated or invalid id fails the token, ERR_BAD_EXPERT,
// recorded by part 0, and nothing of it is stored) and takes each of its pairs' slot in its own lane, all
// atomics in flight at once, and counts the block done; then the block stores the row into those slots. The
// last block ends the receive half as moecomm_dispatch_local's does. It writes what
// dispatch_send writes, but for the records: the token's own record is record t (f.recv_buf row t: metadata,
// f.slot_of), so there are m of them and no record atomic; the signal carries m. A call given sources
// (call_sources: gpu_plan.py's dispatch_sources) also writes them: each pair's token into its slot of src_info
// beside f.slot_of, and the last block, once the counts are stored, the rest (local_sources).
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_dispatch_tokens(const Fixed f, const Call c) {
  after_previous_kernel();
  TRACE_SPAN(MOECOMM_TRACE_DISPATCH_SEND, 0);
  TRACE(MOECOMM_TRACE_DISPATCH_SEND, 0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int parts = gridDim.x / f.max_tokens, t = blockIdx.x / parts, part = blockIdx.x % parts;
  const bool mine = lane % parts == part;  // lane k's pair is this block's to route and store
  const unsigned epoch = f.state[MOECOMM_S_EPOCH_DS] + 1;
  // loaded before m is known: any row < min(c.rows, max_tokens) is readable
  const bool readable = t < min(c.rows, f.max_tokens);
  const uint8_t* const xt = c.x + (size_t)t * source_row_bytes(f);
  const uint8_t* const scales = c.x_scale + (size_t)t * f.scale_bytes;
  const size_t pair = (size_t)t * f.topk + lane;
  int e = -1;  // warp 0, lane k: the token's k-th id and weight; every lane: its tag (tag_of)
  float w = 0.0f;
  if (warp == 0 && readable && lane < f.topk) {
    e = expert_id(c, pair, f.num_experts);
    if (c.weights) w = c.weights[pair];
  }
  const int tag = warp == 0 && readable ? tag_of(f, c, t) : -1;
  const bool masked = warp == 0 && f.mask[f.rank];
  RowCopy row(f.quant != 0);
  if (readable) row.load(f, xt, scales);
  zero_next_rows(f);
  const unsigned counted = f.tag_ring || f.gap_ring ? call_row(f) : 0u;  // tags' and confidence's row
  const int m = dispatch_begin(f, c, epoch);
  const Sources sources = call_sources(c);
  if (sources.src_info && warp > 0) fill_sources(f, sources);  // beside warp 0's routing
  TRACE(MOECOMM_TRACE_DISPATCH_SEND, 1);
  __shared__ uint8_t* xd[MOECOMM_MAX_TOPK];  // the token's rows of c.out_x and c.out_scale, compacted
  __shared__ uint8_t* sd[MOECOMM_MAX_TOPK];
  __shared__ int n;
  bool gap = false;  // warp 0: the token's router confidence is counted (after its row is stored)
  if (warp == 0 && t < m) {
    const bool first_e = first_of(e);
    const unsigned pairs = __ballot_sync(FULL, e >= 0);
    if (!__all_sync(FULL, e < f.num_experts && (e < 0 || first_e))) {
      if (lane == 0) {
        if (part == 0) {
          record_error(f.err, MOECOMM_ERR_BAD_EXPERT, f.rank, MOECOMM_PHASE_DISPATCH, t, (int)epoch);
          atomicCAS(&f.state[MOECOMM_S_BAD], 0u, (unsigned)MOECOMM_ERR_BAD_EXPERT);
        }
        n = 0;
      }
    } else if (!tag_ok(f, c, tag)) {  // the same in every lane
      if (lane == 0) {
        if (part == 0) {
          record_error(f.err, MOECOMM_ERR_BAD_TAG, f.rank, MOECOMM_PHASE_DISPATCH, t, (int)epoch, tag);
          atomicCAS(&f.state[MOECOMM_S_BAD], 0u, (unsigned)MOECOMM_REASON_BAD_TAG);
        }
        n = 0;
      }
    } else {
      gap = part == 0;
      const int lo = f.rank * f.local_experts;
      const int pe = e >= 0 && !masked ? physical(f, e, t) : -1;  // the pair's physical expert; -1: not sent
      const bool take = pe >= 0 && mine;
      const unsigned slot = take ? atomicAdd(&f.state[f.s_expert + pe - lo], 1u) : 0u;
      const int where = take && slot < (unsigned)f.cap ? (pe - lo) * f.cap + (int)slot : -1;
      if (where >= 0) count_tag(f, tag, pe - lo, counted);
      const unsigned drops = __ballot_sync(FULL, take && where < 0 && f.drop);  // parts 1 where any can drop
      const unsigned rows = __ballot_sync(FULL, where >= 0);
      if (where >= 0) {
        const int pos = __popc(rows & ((1u << lane) - 1));
        xd[pos] = c.out_x + (size_t)where * f.x_bytes;
        sd[pos] = scale_row(f, c, where);
      }
      const size_t rec = (size_t)f.rank * f.max_tokens + t;  // this rank's own record t
      int* const meta = meta_of(f.recv_buf + rec * f.rec_bytes, f);
      if (lane == 0) {
        n = __popc(rows);
        if (part == 0) {
          meta[0] = t;
          if (masked) tally(f, MOECOMM_C_MASKED_PAIRS, __popc(pairs));
        }
        if (drops)  // read by combine_local
          f.drop_buf[(size_t)f.rank * f.max_tokens + t] = epoch_signal(epoch, drops);
      }
      if (lane < f.topk && mine) {
        f.own_of[pair] = make_int2(where, __float_as_int(w));
        f.ids_of[pair] = e;  // combine checks its ids against these
        f.slot_of[rec * f.topk + lane] = where;
        meta[1 + lane] = pe;
        ((float*)meta)[1 + f.topk + lane] = w;
        if (f.sent) f.sent[pair] = pe;  // the routing plan's (backward.cu)
      }
    }
    TRACE(MOECOMM_TRACE_DISPATCH_SEND, 2);
  }
  // The block counts itself done before its row is stored: the last block needs every block's slot atomics
  // and error words (warp 0's), not the rows, which nothing in this kernel reads. A grid of one block is its
  // own last (the kernel's end orders its writes for the next kernel).
  __shared__ bool last;
  if (sources.src_info) __syncthreads();  // the block's share of src_info filled before it counts itself done
  if (warp == 0) {
    __syncwarp();  // warp 0's atomics and words, observed by its lane 0 before its fence
    if (lane == 0) last = gridDim.x == 1 || count_block(&f.state[MOECOMM_S_DONE_DS], false);
  }
  __syncthreads();
  if (t < m) row.store(f, xd, sd, n, 0, xt, scales);
  if (gap) count_gap(f, c, e, w, counted);  // off the slots' path: nothing of this call reads it
  TRACE(MOECOMM_TRACE_DISPATCH_SEND, 3);
  if (last) {
    dispatch_sent(f, c, epoch, true, m);
    if (sources.src_info) {
      __syncthreads();  // the counts (c.out_num) and the signal, stored by other threads
      local_sources(f, c, sources);
    }
  }
  TRACE_SPAN(MOECOMM_TRACE_DISPATCH_SEND, 1);
}

// grid: any number of blocks. The send half alone (dispatch_send.cu: every token stored straight into its
// expert slots, a token per block, pipelined where a block has several), whose last block also ends the receive
// half (dispatch_counts): no signal is waited for.
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_dispatch_local(const Fixed f, const Call c) {
  after_previous_kernel();
  TRACE_SPAN(MOECOMM_TRACE_DISPATCH_SEND, 0);
  zero_next_rows(f);
  dispatch_send<true>(f, c, gridDim.x, true);
  TRACE_SPAN(MOECOMM_TRACE_DISPATCH_SEND, 1);
}

// grid: any number of blocks (gpu_plan.py: _sum_blocks). Each token's sum is formed straight from its expert
// rows in c.y, as combine_send and combine_recv would form and add its partial sum: its pairs' slots and
// dispatched weights from f.own_of (dispatch_send), or the weights of c.weights where the dispatch had none
// (c.partials 0). No partial sum, signal or grid-wide count: a block ends with its work. Work items, handed
// out strided: (token t < m, slice s of its row's 8-value chunks), `slices` per token so that a small batch
// fills the grid; the block's threads share a slice, all of a chunk's rows (up to 8) loaded before the first
// add; each warp lists the token's rows itself (no block barrier). Writes rows 0..m-1 of c.out_tokens
// [rows, hidden] out_dtype (a token with no row gets zeros) and, when given, c.out_dropped [rows, topk] uint8
// (from f.drop_buf, which dispatch_send wrote), and with c.zero_tail zeros in the rest of c.out_tokens' rows
// (fill_rows: NaN in every row where combine_check finds the call failed, with c.nan_failed). Expert ids other
// than the dispatch's (f.ids_of; read beside the pairs by warp 0 of each token's first slice, compared after its
// sum) are recorded as this rank's error. The call number is
// the dispatch's: every block stores it as the combine's (no block of this call reads it) and in its own word of
// state[s_combined] (a combine replayed twice after one dispatch finds it there: ERR_ORDER); state[BAD_RECV] is
// cleared by the next dispatch_send.
// The ranks layout at world size 1 (f.packed == PACK_RANKS; gpu_plan.py: whole_kernels) sums alike: a token's one
// row, from its first pair of f.own_of (place_rows, dispatch_recv.cu: its row, weight 1), and its side row from
// c.weights (expert_weights [rows, topk] float32) into c.out_dropped (out_weights, the layout's), zeros where it
// has none; the blocks clear the next dispatch's token bits (present()) as combine_send does.
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_combine_local(const Fixed f, const Call c) {
  after_previous_kernel();
  TRACE_SPAN(MOECOMM_TRACE_COMBINE_SEND, 0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned epoch = f.state[MOECOMM_S_EPOCH_DS];
  // the call this block last combined: its own word (a block of this launch may have ended and stored
  // state[EPOCH_CS] already), the dispatch's call when a combine was replayed twice after it
  unsigned* const combined = &f.state[f.s_combined + blockIdx.x];
  const bool again = *combined == epoch;
  const int chunks = f.hidden / 8;
  const int rows_max = min(c.rows, f.max_tokens);  // m, once checked, is at most this: the slices are known early
  const int most_slices = (chunks + MOECOMM_SUM_SLICE_CHUNKS - 1) / MOECOMM_SUM_SLICE_CHUNKS;
  const int slices = max(1, min((int)gridDim.x / max(rows_max, 1), most_slices));
  const int per = (chunks + slices - 1) / slices;
  __shared__ const uint8_t* rows[THREADS / 32][MOECOMM_MAX_TOPK];  // each warp's list of the token's rows
  __shared__ float wts[THREADS / 32][MOECOMM_MAX_TOPK];
  // the pairs of an item's token (lane k: its k-th): the block's first loaded beside the checks; in warp 0 of a
  // token's first slice also the ids given and dispatched
  int2 own = make_int2(-1, 0);
  float w = 0.0f;
  int given = 0, dispatched = 0;
  const bool ranks = f.packed == MOECOMM_PACK_RANKS;
  if (ranks)  // the next dispatch's token bits (this call's were read by its place_rows)
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < present_words(f); i += gridDim.x * blockDim.x)
      present(f, 0)[i] = 0;
  auto load_pairs = [&](int i) {
    const int t = i / slices;
    const size_t pair = (size_t)t * f.topk + lane;
    const bool pairs = t < rows_max && lane < f.topk, ids = pairs && warp == 0 && i % slices == 0;
    own = pairs ? f.own_of[pair] : make_int2(-1, 0);
    w = c.partials || ranks ? __int_as_float(own.y) : pairs ? c.weights[pair] : 0.0f;
    given = ids ? expert_id(c, pair, f.num_experts) : 0;
    dispatched = ids ? f.ids_of[pair] : 0;
  };
  load_pairs(blockIdx.x);
  bool differ = false;  // warp 0: an id of the block's tokens other than the dispatch's
  const CombineCheck check = combine_check(f, c, epoch, again);
  const int m = check.m;
  fill_rows(f, c, m, check.failed);
  for (int i = blockIdx.x; i < m * slices; i += gridDim.x) {
    const int t = i / slices, s = i % slices;
    const size_t pair = (size_t)t * f.topk + lane;
    if (i != (int)blockIdx.x) load_pairs(i);
    const unsigned use = __ballot_sync(FULL, own.x >= 0);
    if (own.x >= 0) {
      const int pos = __popc(use & ((1u << lane) - 1));
      rows[warp][pos] = c.y + (size_t)own.x * f.out_row_bytes;
      wts[warp][pos] = w;
    }
    if (ranks && c.out_dropped && s == 0 && warp == 0) {  // out_weights: the row's side row, or zeros
      const int row = __shfl_sync(FULL, own.x, 0);
      if (lane < f.topk)
        reinterpret_cast<float*>(c.out_dropped)[pair] = row >= 0 && c.weights ? c.weights[(size_t)row * f.topk + lane]
                                                                              : 0.0f;
    } else if (c.out_dropped && s == 0 && warp == 0 && lane < f.topk) {
      const uint64_t d = f.drop_buf ? f.drop_buf[(size_t)f.rank * f.max_tokens + t] : 0;
      c.out_dropped[pair] = (unsigned)(d >> 32) == epoch && ((d >> lane) & 1);
    }
    __syncwarp();
    uint8_t* const dst = c.out_tokens + (size_t)t * f.out_row_bytes;
    weighted_sum<false, false, 8>(f, rows[warp], wts[warp], __popc(use), &dst, 1, threadIdx.x, THREADS, s * per,
                                  min(chunks, (s + 1) * per));
    differ |= given != dispatched;
    __syncwarp();  // the list is rewritten for the next item
  }
  // its rows were summed as dispatched: the call fails here (no peer to tell)
  if (warp == 0 && __any_sync(FULL, differ) && lane == 0)
    record_error(f.err, MOECOMM_ERR_IDS_DIFFER, f.rank, MOECOMM_PHASE_COMBINE, 0, (int)epoch);
  if (threadIdx.x == 0) {
    *combined = epoch;
    f.state[MOECOMM_S_EPOCH_CS] = epoch;
  }
  TRACE_SPAN(MOECOMM_TRACE_COMBINE_SEND, 1);
}
