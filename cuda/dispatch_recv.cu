// Dispatch, receive half: wait for every source rank, fan its records out to the local experts.
// This rank's own tokens were put in place by dispatch_send; their records are only counted here.
#include "alltoall.cuh"

using namespace moecomm;

static __device__ void place_rows(const Fixed& f, const Call& c, unsigned epoch, bool whole);

// One thread: wait for source s's signal; returns its record count (0 when it sent nothing usable), kept in
// state[s_recv + s] for combine_send when `keep`.
static __device__ __forceinline__ unsigned receive(const Fixed& f, const Call& c, int s, unsigned epoch, bool keep) {
  const uint64_t v = f.mask[s] ? 0
      : wait_epoch(f, &f.sig[s], epoch, now_ns() + f.timeout_ns, s, MOECOMM_PHASE_DISPATCH);
  peer_failed(f, c, v, s, MOECOMM_PHASE_DISPATCH, epoch);
  unsigned got = (v & SIG_BAD) || c.skip ? 0 : (unsigned)v & SIG_COUNT;
  const unsigned theirs = ((unsigned)v >> MOECOMM_SIG_COUNT_BITS) & SIG_GEN;
  if (v && !(v & SIG_BAD) && !c.skip && theirs != (f.state[MOECOMM_S_GEN] & SIG_GEN)) {
    record_error(f.err, MOECOMM_ERR_GENERATION, s, MOECOMM_PHASE_DISPATCH, (int)theirs, (int)epoch,
                 (int)(f.state[MOECOMM_S_GEN] & SIG_GEN));
    got = 0;
  }
  if (v && !(v & SIG_BAD) && !c.skip && s != f.rank) {  // the program's call ids (written before the signal)
    const uint64_t mine = call_id_word(c, epoch), their = load_acquire(&f.ids[s]);
    if (their != mine) {
      record_error(f.err, MOECOMM_ERR_CALL_ID, s, MOECOMM_PHASE_DISPATCH, (int)(unsigned)their, (int)epoch,
                   (int)(unsigned)mine);
      got = 0;
    }
  }
  if (got > (unsigned)f.max_tokens) {
    record_error(f.err, MOECOMM_ERR_OVERFLOW, s, MOECOMM_PHASE_DISPATCH, got, (int)epoch);
    got = 0;
  }
  if (keep) {
    f.state[f.s_recv + s] = got;
    if (s != f.rank) tally_bytes(f, MOECOMM_B_DISPATCH_RECEIVED, s, (unsigned long long)got * f.rec_bytes);
  }
  return got;
}

// Thread 0: wait until record j of source src has landed (true: its arrival word holds the call, or the
// source's signal, which follows all its records, counts more than j) or the signal counts fewer (false;
// also after a timeout or abort). `seen` keeps the signal once read.
static __device__ bool arrived(const Fixed& f, int src, int j, unsigned epoch, uint64_t deadline, uint64_t& seen) {
  if (j >= f.max_tokens) return false;
  const uint64_t* word = &f.arrive[(size_t)src * f.max_tokens + j];
  for (unsigned spin = 1;; ++spin) {
    if (load_acquire(word) == epoch) return true;
    if (!seen) {
      const uint64_t v = load_acquire(&f.sig[src]);
      if ((v >> 32) >= epoch) seen = v;
    }
    if (seen) return j < (int)own_count(seen);
    if (give_up(spin, deadline, f.err, f.gone, src, MOECOMM_PHASE_DISPATCH, (int)epoch)) return false;
  }
}

// grid: world * P blocks of MOECOMM_BLOCK_THREADS, spread over the sources with records to unpack (below), one
// block per record at a time (the packed layouts, not streamed: a warp per record, whose row moves only in
// place_rows); each record is read once and stored into every local expert it goes to. Reads
// f.recv_buf, f.arrive and f.sig (this rank's copies); writes c.out_num [local_experts] int32, c.out_x
// [local_experts, cap, hidden] in_dtype, c.out_scale [local_experts, cap, scales] (or [local_experts, scales,
// cap] column-major: scale_row(); or null), and f.slot_of [world, max_tokens, topk]: where record (src, j)'s
// k-th expert slot is (le*cap+slot, or -1). A masked source is not waited for and sends nothing; with c.skip (a
// refused call) the records are not unpacked and nothing is written (the epoch still advances, so the next call
// pairs up). A source whose signal carries another expert-map generation, or flags a failed send, raises
// (ERR_GENERATION, ERR_PEER) and its count is not kept for combine; records of it that landed before the signal
// may have been unpacked already (the call fails on every rank either way).
// Capacity: a pair past its expert's f.cap slots is not stored. f.drop: it is dropped and flagged to the
// token's rank in its f.drop_buf[me][token]; else the last block records ERR_CAPACITY with the expert's
// demand and state[BAD_RECV] makes combine_send flag the call to every peer.
// Rows placed once every count is known (f.packed, gpu_plan.pack): records of every source, this rank's own
// included, get a place among their source's rows of each local expert (slot_of) while the rank's rows last
// (packed layout) or the expert's slots (padded, grouped by source), the same policies; the last block writes
// each (source, expert)'s first row within its expert (sources in rank order) and, in the packed layout,
// c.out_offsets (the experts' first rows); then every block places its share of the rows (place_rows). The ranks
// layout (PACK_RANKS): a row per record, sources in rank order (c.out_offsets [world + 1]: each source's first
// row), each source's rows in token order (the token's bit in present(): rows_below); the pairs are only
// counted per local expert (c.out_num).
// Telemetry (last block): the call's demand per local expert into f.ring, tokens received and pairs
// dropped per expert; bytes received per source.
__device__ void moecomm::dispatch_recv(const Fixed& f, const Call& c, bool whole) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  TRACE(MOECOMM_TRACE_DISPATCH_RECV, 0);
  // The sources whose records are unpacked here: in the padded layout this rank's own tokens are in place
  // already, so the grid serves the other ranks only (combine_send reads the own count from the own
  // signal); a block past the last whole part (part == parts) only waits. Blocks count from the grid's
  // last one: the first blocks send (dispatch.cu), so the last ones start receiving first.
  const bool others = !f.packed && f.world > 1;
  const int served = others ? f.world - 1 : f.world, parts = gridDim.x / served;
  const int b = gridDim.x - 1 - blockIdx.x, k = b % served, part = b / served;
  const int src = others && k >= f.rank ? k + 1 : k;
  const unsigned epoch = f.state[MOECOMM_S_EPOCH_DR] + 1;
  zero_next_rows(f);  // tags: the next call's row
  // f.streamed: records of a source this rank maps are unpacked as they land: the blocks serving it claim
  // them one at a time (state[s_claim + src]) and each waits for its record's arrival word or the source's
  // signal (its count, which ends the claims). Otherwise, and for sources reached by puts, masked, or with
  // c.skip: the signal first, then the block's static share.
  // (This rank's own records: padded, none; whole, metadata only, written with no arrival word.)
  const bool streamed = f.streamed && !c.skip && part < parts && !(src == f.rank && (!f.packed || whole)) &&
                        !f.mask[src] &&
                        peer_ptr(f.peers, f.recv_buf, src) != nullptr;
  __shared__ unsigned count;
  __shared__ int cur[2], n[2];
  __shared__ uint8_t* xdst[2][MOECOMM_MAX_TOPK];  // two lists of a record's rows and scales (streamed: in turn)
  __shared__ uint8_t* sdst[2][MOECOMM_MAX_TOPK];
  if (threadIdx.x == 0) count = streamed ? 0 : receive(f, c, src, epoch, part == 0);
  __syncthreads();
  const int lo = f.rank * f.local_experts;
  const int records = (src == f.rank && !f.packed) || part >= parts ? 0 : (int)count;
  auto record = [&](int j) { return f.recv_buf + ((size_t)src * f.max_tokens + j) * f.rec_bytes; };
  // thread 0: the next record (streamed: claimed, in flight while the block unpacks the current one)
  unsigned* const claims = &f.state[f.s_claim + src];
  const uint64_t deadline = now_ns() + f.timeout_ns;
  uint64_t seen = 0;  // thread 0, streamed: the source's signal once seen
  int next = streamed && threadIdx.x == 0 ? (int)atomicAdd(claims, 1u) : part;
  bool flagged = false;  // this thread set drop words (completed before the block ends)
  auto take = [&]() {  // thread 0: the record to unpack now, -1 when none is left
    int j = next;
    if (streamed) {
      if (arrived(f, src, j, epoch, deadline, seen)) next = (int)atomicAdd(claims, 1u);
      else j = -1;
    } else {
      if (j < records) next += parts;
      else j = -1;
    }
    return j;
  };
  auto route = [&](int j, int b) {  // warp 0: a slot in each local expert of record j (lanes; id -1 is none)
    const uint8_t* rec = record(j);
    const int id = lane < f.topk ? meta_of(rec, f)[1 + lane] : -1;
    const int tag = f.num_tags ? meta_of(rec, f)[1 + 2 * f.topk] : -1;  // the token's (-1: none)
    int where = -1;
    bool dropped = false;
    if (lane < f.topk) {
      const int le = id - lo;
      if (id >= 0 && le >= 0 && le < f.local_experts) {
        const unsigned slot = atomicAdd(&f.state[f.s_expert + le], 1u);  // the expert's demand
        const bool room = f.packed == MOECOMM_PACK_LAYOUT  // a row of the rank's, or a slot of the expert's
            ? atomicAdd(&f.state[MOECOMM_S_ROWS], 1u) < (unsigned)f.cap : slot < (unsigned)f.cap;
        if (!room)
          dropped = f.drop;
        else if (f.packed == MOECOMM_PACK_RANKS)  // counted only: the record's one row is lane 0's, below
          where = 0;
        else if (f.packed)  // its place among the source's rows of the expert: place_rows adds their first row
          where = (int)atomicAdd(&f.state[f.s_kept + src * f.local_experts + le], 1u);
        else
          where = le * f.cap + slot;
        if (where >= 0) count_tag(f, tag, le, call_row(f));
      }
      if (f.packed == MOECOMM_PACK_RANKS) where = lane == 0 ? 0 : -1;  // place_rows writes lane 0's row
      f.slot_of[((size_t)src * f.max_tokens + j) * f.topk + lane] = where;
    }
    if (f.packed == MOECOMM_PACK_RANKS && lane == 0) {  // the token's bit: its row's place within the source
      const int t = meta_of(rec, f)[0];
      atomicOr(&present(f, src)[t >> 5], 1u << (t & 31));
    }
    const unsigned drops = __ballot_sync(FULL, dropped);
    if (drops && lane == 0) {  // tell the token's rank (read by its combine_recv after our combine signal)
      const int t = meta_of(rec, f)[0];
      signal_set(f.peers, &f.drop_buf[(size_t)f.rank * f.max_tokens + t], epoch_signal(epoch, drops), src);
      flagged = true;
    }
    if (!f.packed) list_rows(f, c, where, xdst[b], sdst[b], &n[b]);  // packed: place_rows places the rows
  };
  if (!streamed && f.packed) {  // no row moves here (place_rows places them): each warp routes records of its own
    for (int j = part + warp * parts; j < records; j += parts * (THREADS / 32)) route(j, 0);
  } else if (!streamed) {  // a record at a time: its row in flight while warp 0 takes its slots
    for (bool first = true;; first = false) {
      if (threadIdx.x == 0) cur[0] = take();
      __syncthreads();
      const int j = cur[0];
      if (first) TRACE(MOECOMM_TRACE_DISPATCH_RECV, 1);
      if (j < 0) break;
      const uint8_t* rec = record(j);
      RowCopy row;  // padded layout: the record's row and scales
      if (!f.packed) row.load(f, rec, rec + f.x_bytes);
      if (warp == 0) route(j, 0);
      __syncthreads();
      if (first) TRACE(MOECOMM_TRACE_DISPATCH_RECV, 2);
      if (!f.packed) row.store(f, xdst[0], sdst[0], n[0], 0, rec, rec + f.x_bytes);
      __syncthreads();
      if (first) TRACE(MOECOMM_TRACE_DISPATCH_RECV, 3);
    }
  } else {  // warp 0 takes and routes the next record (two lists in turn) while the other warps copy one
    auto take_and_route = [&](int b) {
      const int j = __shfl_sync(FULL, lane == 0 ? take() : 0, 0);
      if (lane == 0) cur[b] = j;
      if (j >= 0) route(j, b);
    };
    if (warp == 0) take_and_route(0);
    __syncthreads();
    TRACE(MOECOMM_TRACE_DISPATCH_RECV, 1);  // here the first record's arrival and its slots end together
    TRACE(MOECOMM_TRACE_DISPATCH_RECV, 2);
    for (int i = 0; cur[i & 1] >= 0; ++i) {
      const int b = i & 1;
      if (warp == 0) {
        take_and_route(b ^ 1);
      } else if (!f.packed) {
        const uint8_t* rec = record(cur[b]);
        RowCopy row;
        row.load(f, rec, rec + f.x_bytes, threadIdx.x - 32, THREADS - 32);
        row.store(f, xdst[b], sdst[b], n[b], 0, rec, rec + f.x_bytes, threadIdx.x - 32, THREADS - 32);
      }
      __syncthreads();
      if (i == 0) TRACE(MOECOMM_TRACE_DISPATCH_RECV, 3);
    }
  }
  if (streamed && part == 0 && threadIdx.x == 0) receive(f, c, src, epoch, true);  // errors, the count for combine
  if (flagged) quiet();  // drop words to peers without a mapping
  TRACE(MOECOMM_TRACE_DISPATCH_RECV, 4);
  const bool is_last = last_block(&f.state[MOECOMM_S_DONE_DR], f.drop);  // drop words to mapped peers
  TRACE(MOECOMM_TRACE_DISPATCH_RECV, 5);
  if (is_last) {
    TRACE_LAST_START();
    dispatch_counts(f, c, epoch);
    TRACE_LAST(MOECOMM_TRACE_DISPATCH_RECV);
  }
  if (f.packed) place_rows(f, c, epoch, whole);
}

// The rows' places once every count is known (f.packed), the receive half's last stage in every block of its
// grid, which is resident (gpu_plan's rule for the grids that run dispatch_recv): wait for the last block's
// dispatch_counts (state[EPOCH_DR] = the call; bounded like every wait), then block b takes the records of source
// b % world, b / world + i * parts: each kept (record, k) pair's row (its expert's first, c.out_offsets[expert] or
// expert * cap in the padded layout, plus its source's first row in the expert, source_first, plus its place
// among them) of c.out_x ([cap, hidden], padded [L, cap, hidden]) and c.out_scale (scale_row(); or null) gets
// the record's row and scales, and that row goes back into f.slot_of (combine_send reads expert_y there). The
// ranks layout: the record's one row (source_first[src] plus the source's tokens below its own) into slot_of's
// lane 0, and at world size 1 into f.own_of's first pair of its token (the rest -1 from dispatch_send), which
// the local combine sums (local.cu). `whole` (dispatch_send's Whole): this rank's own records carry no row,
// which comes from c.x (its token's row and scales, quantised as dispatch_send does where f.quant).
static __device__ void place_rows(const Fixed& f, const Call& c, unsigned epoch, bool whole) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __shared__ bool counted;
  if (threadIdx.x == 0) {
    const uint64_t deadline = now_ns() + f.timeout_ns;
    bool ready;
    for (unsigned spin = 1; !(ready = load_acquire(&f.state[MOECOMM_S_EPOCH_DR]) == epoch); ++spin)
      if (give_up(spin, deadline, f.err, f.gone, f.rank, MOECOMM_PHASE_DISPATCH, (int)epoch)) break;
    counted = ready;
  }
  __syncthreads();
  if (!counted || c.skip) return;
  const int src = blockIdx.x % f.world, parts = gridDim.x / f.world;
  const int lo = f.rank * f.local_experts;
  const int records = (int)f.state[f.s_recv + src];
  __shared__ int n;
  __shared__ uint8_t* xdst[MOECOMM_MAX_TOPK];
  __shared__ uint8_t* sdst[MOECOMM_MAX_TOPK];
  for (int j = blockIdx.x / f.world; j < records; j += parts) {
    const uint8_t* rec = f.recv_buf + ((size_t)src * f.max_tokens + j) * f.rec_bytes;
    const bool from_x = whole && src == f.rank;
    const int t = from_x ? meta_of(rec, f)[0] : 0;
    const uint8_t* const xs = from_x ? c.x + (size_t)t * source_row_bytes(f) : rec;
    const uint8_t* const ss = from_x ? c.x_scale + (size_t)t * f.scale_bytes : rec + f.x_bytes;
    RowCopy copy(from_x && f.quant);
    copy.load(f, xs, ss);  // in flight while warp 0 finds the rows
    if (warp == 0) {
      int row = -1;
      if (f.packed == MOECOMM_PACK_RANKS) {  // one row: the source's first, plus its tokens below this one
        int* slot = &f.slot_of[((size_t)src * f.max_tokens + j) * f.topk];
        const int below = rows_below(present(f, src), meta_of(rec, f)[0]);
        if (lane == 0 && *slot >= 0) {
          row = (int)source_first(f)[src] + below;
          *slot = row;
          if (f.world == 1)  // the local combine's pair (local.cu): the row, its weight 1 (a sum already)
            f.own_of[(size_t)meta_of(rec, f)[0] * f.topk] = make_int2(row, __float_as_int(1.0f));
        }
      } else if (lane < f.topk) {
        int* slot = &f.slot_of[((size_t)src * f.max_tokens + j) * f.topk + lane];
        if (*slot >= 0) {
          const int le = meta_of(rec, f)[1 + lane] - lo;
          const int first = f.packed == MOECOMM_PACK_LAYOUT ? c.out_offsets[le] : le * f.cap;
          row = first + (int)source_first(f)[src * f.local_experts + le] + *slot;
          *slot = row;
        }
      }
      list_rows(f, c, row, xdst, sdst, &n);
    }
    __syncthreads();
    copy.store(f, xdst, sdst, n, 0, xs, ss);
    __syncthreads();
  }
}

// The receive half's end, by the block that finishes it (every thread): each local expert's count into c.out_num
// (with each source's first row in it where f.packed, and c.out_offsets in the packed layout), the capacity
// policy's verdict (counters, or ERR_CAPACITY and state[BAD_RECV]), telemetry, and the per-call state reset for
// the next call, whose number `epoch` then is.
__device__ void moecomm::dispatch_counts(const Fixed& f, const Call& c, unsigned epoch) {
  const int lo = f.rank * f.local_experts;
  const size_t row = f.window ? (size_t)(f.counters[MOECOMM_C_CALLS] % f.window) * f.local_experts : 0;
  const bool per_rank = f.packed == MOECOMM_PACK_LAYOUT;  // the capacity holds rows of the rank
  for (int le = threadIdx.x; le < f.local_experts; le += blockDim.x) {
    const unsigned demand = atomicExch(&f.state[f.s_expert + le], 0u);
    unsigned kept = min(demand, (unsigned)f.cap);
    if (f.packed && f.packed != MOECOMM_PACK_RANKS) {  // each source's first row in the expert, in rank order
      kept = 0;
      for (int s = 0; s < f.world; ++s) {
        const int i = s * f.local_experts + le;
        source_first(f)[i] = kept;
        kept += atomicExch(&f.state[f.s_kept + i], 0u);
      }
    }
    const unsigned over = demand - kept;
    if (c.skip) continue;
    c.out_num[le] = kept;
    if (f.window) {
      f.ring[row + le] = demand;
      tally(f, f.c_received + le, kept);
    }
    if (over && f.drop) {
      tally(f, f.c_dropped + le, over);
      tally(f, MOECOMM_C_DROPPED_PAIRS, over);
    } else if (over) {
      tally(f, MOECOMM_C_OVERFLOW_PAIRS, over);
    }
    if (over && !f.drop && !per_rank && atomicCAS(&f.state[MOECOMM_S_BAD_RECV], 0u,
                                 MOECOMM_ERR_CAPACITY | (lo + le + 1) << MOECOMM_REASON_ARG_SHIFT) == 0u) {
      f.state[MOECOMM_S_WHY] = demand;
      record_error(f.err, MOECOMM_ERR_CAPACITY, f.rank, MOECOMM_PHASE_DISPATCH, lo + le, (int)epoch, (int)demand);
    }
  }
  if (threadIdx.x == 0 && per_rank) {  // the rank's rows against its capacity ("error"; "drop" counted above)
    const unsigned rows = atomicExch(&f.state[MOECOMM_S_ROWS], 0u);
    if (!c.skip && !f.drop && rows > (unsigned)f.cap &&
        atomicCAS(&f.state[MOECOMM_S_BAD_RECV], 0u, MOECOMM_ERR_CAPACITY) == 0u) {
      f.state[MOECOMM_S_WHY] = rows;
      record_error(f.err, MOECOMM_ERR_CAPACITY, f.rank, MOECOMM_PHASE_DISPATCH, -1, (int)epoch, (int)rows);
    }
  }
  for (int s = threadIdx.x; s < f.world; s += blockDim.x) f.state[f.s_claim + s] = 0;
  __syncthreads();
  if (threadIdx.x == 0) {
    if (per_rank && !c.skip) {  // each expert's first row, from the kept counts the loop above wrote
      int first = 0;
      for (int le = 0; le < f.local_experts; ++le) {
        c.out_offsets[le] = first;
        first += c.out_num[le];
      }
      c.out_offsets[f.local_experts] = first;
    }
    if (f.packed == MOECOMM_PACK_RANKS && !c.skip) {  // each source's first row, sources in rank order
      int first = 0;
      for (int s = 0; s < f.world; ++s) {
        source_first(f)[s] = first;
        c.out_offsets[s] = first;
        first += (int)f.state[f.s_recv + s];
      }
      c.out_offsets[f.world] = first;
    }
    if (!c.skip) tally(f, MOECOMM_C_CALLS, 1);  // an atomic, not waited for (a plain ++ waits for the load)
    f.state[MOECOMM_S_DONE_DR] = 0;
    if (f.packed) __threadfence();  // the block's counts and first rows before the word place_rows waits for
    f.state[MOECOMM_S_EPOCH_DR] = epoch;
  }
}

extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_dispatch_recv(const Fixed f, const Call c) {
  after_previous_kernel();
  TRACE_SPAN(MOECOMM_TRACE_DISPATCH_RECV, 0);
  dispatch_recv(f, c);
  TRACE_SPAN(MOECOMM_TRACE_DISPATCH_RECV, 1);
}
