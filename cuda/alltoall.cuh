// Shared by the dispatch/combine kernels: record layout, reading expert ids, copies, signals.
// Their parameters (struct Fixed: the AllToAll's layout, device state and buffers; struct Call: the call's
// arrays) are declared in moecomm_abi.h, generated from moecomm/_abi.py.
//
// Wire plan (bytes per phase are in moecomm/transport/gpu_alltoall.py):
//   dispatch  each token goes once to every other *rank* owning one of its experts, as one record
//             [x | scales | token, expert ids[k], weights[k]] in the receiver's slot recv_buf[src][slot];
//             the receiver fans it out to its local experts. Rows for the sender's own experts are
//             stored in place by the sender, whose own record then holds only the metadata.
//   combine   with the router weights from dispatch: one partial sum per (token, expert rank), out dtype,
//             into comb_buf[expert rank][token] of every rank of the token's DP group; without them: one
//             row per (token, k) into comb_buf[token][k].
// Completion: after its data, a sender sets one 64-bit signal per peer to (epoch << 32 | flags | count).
// At prefill-sized batches (f.streamed) rows stored into mapped peers also get arrival words (struct
// Arrivals): dispatch records (f.arrive[src][slot]), so the receiver unpacks records while later ones are
// still on the way, and in the streamed one-launch combine (f.comb_streamed) the peers' partial sums
// (f.comb_arrive[expert rank][token]), which the token side adds to this rank's own expert rows as they land
// (this rank's own partial sums are then never formed). This assumes ranks map each other or
// neither does (NVLink peers; nodes apart: puts both ways).
// Epochs are counted on the device (state[]), so nothing needs a host reset and CUDA graphs replay.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "transport.cuh"

namespace moecomm {

constexpr unsigned FULL = 0xffffffffu;
// A signal's low 32 bits: a count (records, with the expert-map generation above it; 1 for combine), or
// SIG_BAD | reason when the sender's part of the call failed (nothing was sent; reason: see
// moecomm/_constants.py).
constexpr uint64_t SIG_BAD = 0x80000000ull;
constexpr uint64_t SIG_REASON = 0x7fffffffull;
constexpr unsigned SIG_COUNT = (1u << MOECOMM_SIG_COUNT_BITS) - 1;
constexpr unsigned SIG_GEN = (1u << MOECOMM_SIG_GEN_BITS) - 1;
// state[MOECOMM_S_M] after a dispatch whose bound_m was out of range or whose send half failed (combine then
// writes nothing).
constexpr unsigned M_INVALID = 0x80000000u;

// The four halves, each defined in its own file (dispatch_send.cu, ...) with a kernel that runs it alone.
// dispatch.cu and combine.cu run a phase's two halves in one launch: every block does its part of the send
// half, then its part of the receive half, in a grid that suits both (world * parts blocks, all resident:
// a block waiting in the receive half never keeps a send block of its own grid from running).
// dispatch_send sends on the grid's first `senders` blocks: all of them in the split kernel, f.senders in the
// one-launch kernel (a share of it where records stream: its other blocks unpack the records that have landed,
// from HBM, while the sends keep NVLink busy; moecomm/transport/gpu_plan.py, dispatch_senders).
// Pipelined: the one-launch kernel of streamed batches (moecomm_dispatch_streamed) and the local path's
// (local.cu), whose sending blocks route a token while they send the one before where they have several, in a
// build without puts (HAS_PUTS, transport.cuh); the other kernels carry none of that code. `local` (local.cu:
// world size 1, the padded layout, so that no record is unpacked): the send half's last block also ends the
// receive half, dispatch_counts (the counts per local expert, telemetry, the receive half's call number).
// Whole / `whole` (dispatch.cu: the receive half runs in the same launch, so c.x is still the call's): in the
// packed layouts (f.packed) this rank's own record carries its token's metadata only, and place_rows reads the
// row from c.x, so the rank's own rows are copied once (at world size 1, every row).
// combine_send returns its call number, which combine_recv waits for (the split kernel reads it back from
// state[EPOCH_CS]). `stream`: the one-launch combine's streamed form (combine.cu). Wire: the combine's rows
// travel on the FP8 combine wire (f.wire; weighted_sum), in kernels of their own (moecomm_combine*_wire), so
// that the out-dtype kernels carry none of its code.
template <bool Pipelined, bool Whole = false>
__device__ void dispatch_send(const Fixed& f, const Call& c, int senders, bool local = false);
__device__ void dispatch_recv(const Fixed& f, const Call& c, bool whole = false);
__device__ void dispatch_counts(const Fixed& f, const Call& c, unsigned epoch);
template <bool Wire>
__device__ unsigned combine_send(const Fixed& f, const Call& c, bool stream);
template <bool Wire>
__device__ void combine_recv(const Fixed& f, const Call& c, unsigned epoch, bool stream);

// Record metadata after x and scales: int32 token, int32 expert[topk], float weight[topk].
__device__ __forceinline__ int* meta_of(uint8_t* rec, const Fixed& f) { return (int*)(rec + f.meta_off); }
__device__ __forceinline__ const int* meta_of(const uint8_t* rec, const Fixed& f) {
  return (const int*)(rec + f.meta_off);
}

// Expert id i of the call's [rows, topk] ids, read as given: int32 (uint32 reads alike: 0xffffffff is -1)
// or int64. -1 means "no expert" (nothing sent, nothing combined); an id outside [-1, num_experts) comes
// back as num_experts, which every caller treats as invalid.
__device__ __forceinline__ int expert_id(const Call& c, size_t i, int num_experts) {
  const long long v = c.idx64 ? ((const long long*)c.indices)[i] : ((const int*)c.indices)[i];
  return v >= -1 && v < num_experts ? (int)v : num_experts;
}

// The expert slot a valid logical id e of token t goes to: e itself without an expert map; with one, replica
// (t * REPLICA_TOKEN + dp_group * REPLICA_GROUP) mod 2^32 mod replicas of e (moecomm.balance.ExpertMap.physical).
// A masked rank's replicas are passed over: the first replica from that one on (wrapping) whose rank is not
// masked (f.mask), or that one when every replica's rank is (the pair is then not sent).
__device__ __forceinline__ int physical(const Fixed& f, int e, int t) {
  if (!f.map) return e;
  const int* row = f.map + (size_t)e * (1 + f.world);
  const unsigned h = (unsigned)t * MOECOMM_REPLICA_TOKEN + (unsigned)(f.rank / f.dp) * MOECOMM_REPLICA_GROUP;
  const int n = row[0], j = (int)(h % (unsigned)n);
  for (int i = 0; i < n; ++i) {
    const int slot = row[1 + (j + i) % n];
    if (!f.mask[slot / f.local_experts]) return slot;
  }
  return row[1 + j];
}

// Tags (f.num_tags): token t's tag as given (c.tags), -1 where the call gives none; tag_ok(): it is in [0,
// num_tags), or the call gives none.
__device__ __forceinline__ int tag_of(const Fixed& f, const Call& c, int t) {
  return f.num_tags && c.tags && t < c.rows ? c.tags[t] : -1;
}
__device__ __forceinline__ bool tag_ok(const Fixed& f, const Call& c, int tag) {
  return !f.num_tags || !c.tags || (tag >= 0 && tag < f.num_tags);
}

// Tags and router confidence are counted straight into this call's rows of their windows: f.tag_ring and
// f.gap_ring have f.tally_rows rows (a power of two above the window), the call's at CALLS % tally_rows (CALLS is
// counted by the call's last block, after every count; call_row()). Every block of the kernels that end a
// dispatch (the receive half's, the local path's) zeroes its share of the next call's rows (zero_next_rows()):
// no block of this call counts there and the next call's kernels begin after this call's end, so nothing is
// copied or cleared at the end of a call.
__device__ __forceinline__ unsigned call_row(const Fixed& f) {
  return (unsigned)f.counters[MOECOMM_C_CALLS] & (unsigned)(f.tally_rows - 1);
}
__device__ __forceinline__ void zero_next_rows(const Fixed& f) {
  if (!f.tag_ring && !f.gap_ring) return;
  const unsigned next = (call_row(f) + 1) & (unsigned)(f.tally_rows - 1);
  const int tagged = f.num_tags * f.local_experts;
  const int first = blockIdx.x * blockDim.x + threadIdx.x, stride = gridDim.x * blockDim.x;
  if (f.tag_ring)
    for (int i = first; i < tagged; i += stride) f.tag_ring[(size_t)next * tagged + i] = 0u;
  if (f.gap_ring)
    for (int i = first; i < MOECOMM_GAP_BINS; i += stride) f.gap_ring[next * MOECOMM_GAP_BINS + i] = 0u;
}

// A pair kept by local expert le, of a token with tag `tag` (-1: none), into this call's `row` (call_row(), read
// before the block counted itself done).
__device__ __forceinline__ void count_tag(const Fixed& f, int tag, int le, unsigned row) {
  if (f.tag_ring && tag >= 0 && tag < f.num_tags)
    atomicAdd(&f.tag_ring[((size_t)row * f.num_tags + tag) * f.local_experts + le], 1u);
}

// Router confidence (score_gap), warp-wide: lane k holds a valid token's k-th expert id e (-1: none) and router
// weight w; the token's gap between its largest and smallest weight over its ids, when it has two or more, is
// counted in its bin (MOECOMM_GAP_EDGES, as moecomm.reference.score_gap_bins) by lane 0, into this call's `row`
// (as count_tag's).
__device__ __forceinline__ void count_gap(const Fixed& f, const Call& c, int e, float w, unsigned row) {
  if (!f.gap_ring || !c.weights) return;
  const bool id = e >= 0;
  const int ids = __popc(__ballot_sync(FULL, id));
  const float inf = __int_as_float(0x7f800000);
  float hi = id ? w : -inf, lo = id ? w : inf;
  for (int o = 16; o; o >>= 1) {
    hi = fmaxf(hi, __shfl_xor_sync(FULL, hi, o));
    lo = fminf(lo, __shfl_xor_sync(FULL, lo, o));
  }
  if (ids >= 2 && (threadIdx.x & 31) == 0) {
    constexpr float edges[MOECOMM_GAP_BINS] = MOECOMM_GAP_EDGES;
    const float gap = hi - lo;
    int bin = 0;
    for (int i = 1; i < MOECOMM_GAP_BINS; ++i) bin += gap >= edges[i];
    atomicAdd(&f.gap_ring[(size_t)row * MOECOMM_GAP_BINS + bin], 1u);
  }
}

// Warp-wide (every lane calls it): whether no lane below this one holds the same v (a token's pairs: an expert
// repeated, a rank that an earlier pair already sends to).
__device__ __forceinline__ bool first_of(int v) {
  return !(__match_any_sync(FULL, v) & ((1u << (threadIdx.x & 31)) - 1));
}

// Telemetry: add to counter i (relaxed; read by the host after the work ends).
__device__ __forceinline__ void tally(const Fixed& f, int i, unsigned long long n) {
  if (n) atomicAdd(&f.counters[i], n);
}
// Telemetry (f.window > 0): add n to the bytes counter `kind` (MOECOMM_B_*) of peer q.
__device__ __forceinline__ void tally_bytes(const Fixed& f, int kind, int q, unsigned long long n) {
  if (f.window) tally(f, f.c_bytes + kind * f.world + q, n);
}

// Work is handed out a token (or record) per block: the block's THREADS threads share each row, so a row
// costs one or two rounds of loads instead of a warp's many. Up to MOECOMM_MAX_TOPK + 1 destinations per
// row (experts or peers, plus a staging row).
constexpr int MAX_FANOUT = MOECOMM_MAX_TOPK + 1;
constexpr int THREADS = MOECOMM_BLOCK_THREADS;
constexpr int ARRIVAL_BATCH = MOECOMM_ARRIVAL_BATCH;  // rows a sending block stores per fence, at most (Arrivals)
constexpr int INFLIGHT = 4;  // 16-byte loads per thread in flight in copies: a 16 KB row in one round

// Block-wide (or by the block's threads tid = 0..nthreads-1): copy `bytes` (a multiple of 16) from src to
// dsts[0..n), from 16-byte chunk `from` on, loading each chunk once and keeping up to INFLIGHT loads per thread
// in flight (a plain loop would wait for each load: dst may alias src).
__device__ __forceinline__ void fanout16(uint8_t* const* dsts, int n, const uint8_t* src, int bytes, int from = 0,
                                         int tid = threadIdx.x, int nthreads = THREADS) {
  const int4* s = (const int4*)src;
  const int chunks = bytes / 16;
  for (int base = from + tid; base < chunks; base += INFLIGHT * nthreads) {
    int4 v[INFLIGHT];
#pragma unroll
    for (int u = 0; u < INFLIGHT; ++u)
      if (base + u * nthreads < chunks) v[u] = s[base + u * nthreads];
    for (int j = 0; j < n; ++j) {
      int4* d = (int4*)dsts[j];
#pragma unroll
      for (int u = 0; u < INFLIGHT; ++u)
        if (base + u * nthreads < chunks) d[base + u * nthreads] = v[u];
    }
  }
}

// Where rows are placed once counted (f.packed: dispatch_recv.cu's place_rows): [world, local_experts] each
// source's first row within a local expert, sources in rank order (dispatch_counts writes it; it follows the kept
// counts in state).
__device__ __forceinline__ unsigned* source_first(const Fixed& f) {
  return &f.state[f.s_kept + f.world * f.local_experts];
}

// The ranks layout (f.packed == PACK_RANKS): a bit per token of source `src` received (state after the per-source
// claims, moecomm._abi.state_layout: [world, words]). dispatch_recv's route sets a record's bit, place_rows puts
// the record's row among its source's in token order (rows_below), combine_send clears the source's bits.
__device__ __forceinline__ int present_words(const Fixed& f) { return (f.max_tokens + 31) >> 5; }
__device__ __forceinline__ unsigned* present(const Fixed& f, int src) {
  return &f.state[f.s_claim + f.world + src * present_words(f)];
}

// The ranks layout's float32 side row (combine's expert_weights / out_weights, in c.weights / c.out_dropped: the
// record's fields the layout leaves free) travels after each combine row, from its first 16-byte boundary past
// the out_dtype values (moecomm._abi.combine_row_bytes).
__device__ __forceinline__ float* side_row(uint8_t* row, const Fixed& f) {
  return reinterpret_cast<float*>(row + ((f.out_row_bytes + 15) & ~15));
}
__device__ __forceinline__ const float* side_row(const uint8_t* row, const Fixed& f) {
  return reinterpret_cast<const float*>(row + ((f.out_row_bytes + 15) & ~15));
}

// Warp-wide (every lane): the tokens of `bits` below token t, a source's rows before token t's.
__device__ __forceinline__ int rows_below(const unsigned* bits, int t) {
  const int lane = threadIdx.x & 31;
  int below = 0;
  for (int w = lane; w < (t >> 5); w += 32) below += __popc(bits[w]);
  if (lane == 0) below += __popc(bits[t >> 5] & ((1u << (t & 31)) - 1u));
  return __reduce_add_sync(FULL, below);
}

// Where the scales of output row `where` of c.out_scale start: row-major, row `where` of scale_bytes; column-major
// (f.scale_column: [local_experts, scales, cap], packed [scales, cap]), column `where % cap` of its expert's
// block, its scales f.cap elements apart.
__device__ __forceinline__ uint8_t* scale_row(const Fixed& f, const Call& c, int where) {
  if (!f.scale_column) return c.out_scale + (size_t)where * f.scale_bytes;
  const size_t scales = f.scale_bytes / f.scale_item;
  return c.out_scale + ((size_t)(where / f.cap) * scales * f.cap + where % f.cap) * f.scale_item;
}

// Word i (4 bytes of a token's scales, row-major) into an output row at `row` (scale_row()): as one word
// row-major or where scales are words; else (column-major UE8M0 bytes) byte by byte, f.cap bytes apart.
__device__ __forceinline__ void store_scale_word(const Fixed& f, uint8_t* row, int i, int w) {
  if (!f.scale_column) {
    ((int*)row)[i] = w;
  } else if (f.scale_item == 4) {
    *(int*)(row + (size_t)i * f.cap * 4) = w;
  } else {
#pragma unroll
    for (int b = 0; b < 4; ++b) row[(size_t)(4 * i + b) * f.cap] = (uint8_t)(w >> 8 * b);
  }
}

// Block-wide copy of a token row (f.x_bytes at x) and its scales (f.scale_bytes at scales, copied as 4-byte words
// whatever their dtype, not necessarily a multiple of 16; none when 0) in two steps, so that the load is issued
// before the block knows where the row goes: load() takes each thread's first INFLIGHT 16-byte chunks of the row (a
// 16 KB row in all) and its first scale word into registers, in one round trip; store() writes them into the n rows
// xd[j] and sd[j], then copies whatever the first round did not cover. Source and destinations must not alias. Both
// by the block, or both by the same threads tid = 0..nthreads-1 of it.
struct RowCopy;
__device__ __forceinline__ void store_quantised(const Fixed& f, const int4* v, uint8_t* const* xd, uint8_t* const* sd,
                                                int n, int outputs, const uint8_t* x, int tid, int nthreads);

// The bytes of one row of c.x: a quantising dispatch's source rows (f.quant: bf16 / fp16), else x_bytes.
__device__ __forceinline__ int source_row_bytes(const Fixed& f) { return f.quant ? f.src_row_bytes : f.x_bytes; }

struct RowCopy {
  int4 v[INFLIGHT];
  int first;
  bool quant;  // the send side of a quantising dispatch (f.quant): x is a source row, quantised as it is stored
  __device__ explicit RowCopy(bool quantise = false) : quant(quantise) {}
  __device__ __forceinline__ void load(const Fixed& f, const uint8_t* x, const uint8_t* scales,
                                       int tid = threadIdx.x, int nthreads = THREADS) {
    first = !quant && tid < f.scale_bytes / 4 ? ((const int*)scales)[tid] : 0;
    const int chunks = (quant ? f.src_row_bytes : f.x_bytes) / 16;
#pragma unroll
    for (int u = 0; u < INFLIGHT; ++u) {  // quant: a thread's source chunks in adjacent pairs (store_quantised)
      const int c = quant ? 2 * (tid + u / 2 * nthreads) + u % 2 : tid + u * nthreads;
      if (c < chunks) v[u] = ((const int4*)x)[c];
    }
  }
  // x, scales: as given to load() (passed again, not kept: registers are scarce in the one-launch kernels).
  // Destinations from `outputs` on are rows of c.out_x / c.out_scale (scale_row(): their scales in the
  // AllToAll's scale layout); the ones before are records (scales row-major).
  __device__ __forceinline__ void store(const Fixed& f, uint8_t* const* xd, uint8_t* const* sd, int n, int outputs,
                                        const uint8_t* x, const uint8_t* scales, int tid = threadIdx.x,
                                        int nthreads = THREADS) const {
    if (quant) return store_quantised(f, v, xd, sd, n, outputs, x, tid, nthreads);
    const int chunks = f.x_bytes / 16;
    for (int j = 0; j < n; ++j) {
      int4* d = (int4*)xd[j];
#pragma unroll
      for (int u = 0; u < INFLIGHT; ++u)
        if (tid + u * nthreads < chunks) d[tid + u * nthreads] = v[u];
    }
    if (chunks > INFLIGHT * nthreads) fanout16(xd, n, x, f.x_bytes, INFLIGHT * nthreads, tid, nthreads);
    for (int i = tid; i < f.scale_bytes / 4; i += nthreads) {
      const int w = i == tid ? first : ((const int*)scales)[i];
      for (int j = 0; j < n; ++j) {
        if (j < outputs) ((int*)sd[j])[i] = w;
        else store_scale_word(f, sd[j], i, w);
      }
    }
  }
};

// Warp 0 (every lane): list the lanes' rows of c.out_x / c.out_scale (`row` -1: none) in xdst / sdst,
// compacted; lane 0 sets *n. Then the block copies a record there (RowCopy from the record: its row, then
// its scales).
__device__ __forceinline__ void list_rows(const Fixed& f, const Call& c, int row, uint8_t** xdst, uint8_t** sdst,
                                          int* n) {
  const unsigned mask = __ballot_sync(FULL, row >= 0);
  if (row >= 0) {
    const int pos = __popc(mask & ((1u << (threadIdx.x & 31)) - 1));
    xdst[pos] = c.out_x + (size_t)row * f.x_bytes;
    sdst[pos] = scale_row(f, c, row);
  }
  if ((threadIdx.x & 31) == 0) *n = __popc(mask);
}

// Block-wide: put `bytes` of src to remote[j] on pes[j], j < n (non-blocking; complete with quiet).
// Not inlined: NVSHMEM's put path is large and would otherwise take registers from the copy loops.
static __device__ __noinline__ void put_block_all(uint8_t* const* remote, const int* pes, int n,
                                              const uint8_t* src, int bytes) {
  for (int j = 0; j < n; ++j) put_block(remote[j], src, bytes, pes[j]);
}

// A block's ring of staging rows (stage_slots of them), the sources of puts to peers that are not
// load/store reachable. Before a row is reused, the puts that read it must be complete. Every thread of
// the block keeps an identical copy and calls next() together.
struct Stage {
  uint8_t* base;
  int slots, bytes, n;
  bool puts_pending, used_puts;
  __device__ explicit Stage(const Fixed& f)
      : base(f.stage + (size_t)blockIdx.x * f.stage_slots * f.stage_bytes), slots(f.stage_slots),
        bytes(f.stage_bytes), n(0), puts_pending(false), used_puts(false) {}
  __device__ uint8_t* next() {
    if (puts_pending && n % slots == 0) {
      quiet();
      puts_pending = false;
    }
    puts_pending = used_puts = true;
    return base + (size_t)(n++ % slots) * bytes;
  }
};

// Destinations of one row on the peers [q0, q1) (or on a list of ranks: start, add each, finish), built by
// every thread of the block alike: mapped peers get direct stores (into dsts), the others a staged copy
// (appended to dsts) and a put (send_puts).
struct Targets {
  uint8_t** dsts;    // shared, MAX_FANOUT
  uint8_t** remote;  // shared, symmetric addresses of the put targets
  int* pes;          // shared
  int n, n_put;
  uint8_t* staged;
  __device__ void build(const long long* peers, uint8_t* symmetric, int q0, int q1, Stage& st) {
    start();
    for (int q = q0; q < q1; ++q) add(peers, symmetric, q);
    finish(st);
  }
  __device__ __forceinline__ void start() {
    __syncthreads();  // the shared arrays may still be read for the previous row
    n = n_put = 0;
    staged = nullptr;
  }
  __device__ __forceinline__ void add(const long long* peers, uint8_t* symmetric, int q) {
    uint8_t* p = peer_ptr(peers, symmetric, q);
    if (p) {
      if (threadIdx.x == 0) dsts[n] = p;
      ++n;
    } else {
      if (threadIdx.x == 0) {
        remote[n_put] = symmetric;
        pes[n_put] = q;
      }
      ++n_put;
    }
  }
  __device__ __forceinline__ void finish(Stage& st) {
    if (n_put) {
      staged = st.next();
      if (threadIdx.x == 0) dsts[n] = staged;
      ++n;
    }
    __syncthreads();
  }
  __device__ void send_puts(int bytes) {
    if (!n_put) return;
    __syncthreads();  // the staged row is complete
    put_block_all(remote, pes, n_put, staged, bytes);
  }
};

// The bound_m rule, the same on the host (moecomm.reference.m_in_range; a test evaluates this expression
// against it): a call's m is in [0, rows] (the fewest rows of its per-token arrays) and at most max_tokens.
__device__ __forceinline__ bool m_in_range(int m, int rows, int max_tokens) {
  return m >= 0 && m <= rows && m <= max_tokens;
}

// The rows a combine writes besides its tokens' sums, every thread of the grid, strided. Where the call failed
// (`failed`: on this rank or, seen by this block, on a peer) and c.nan_failed, every row of c.out_tokens becomes
// NaN (moecomm.jax: a failed call in a replayed step never returns plausible data); otherwise, with c.zero_tail
// (XLA's result buffers start uninitialised), rows m..c.rows-1 become zeros. `m` is 0 where the call failed.
// Nothing for a record without out_tokens (a skipped call). Rows are whole 16-byte words (MOECOMM_ROW_ALIGN).
static_assert(MOECOMM_ROW_ALIGN % 16 == 0, "fill_rows stores 16-byte words");
__device__ __forceinline__ void fill_rows(const Fixed& f, const Call& c, int m, bool failed) {
  const bool nan = failed && c.nan_failed;
  if (!c.out_tokens || (!nan && (!c.zero_tail || m >= c.rows))) return;
  const unsigned half = f.out_code == MOECOMM_DT_BF16 ? 0x7fc0u : 0x7e00u;  // a quiet NaN of out_dtype
  const unsigned v = nan ? half << 16 | half : 0u;
  uint4* const out = reinterpret_cast<uint4*>(c.out_tokens);
  const size_t end = (size_t)c.rows * f.out_row_bytes / 16, stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = (size_t)m * f.out_row_bytes / 16 + (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < end;
       i += stride)
    out[i] = make_uint4(v, v, v, v);
}

// A combine call's checks, by every thread of its grid. `reason` (0: none) is what the call's signals carry
// where this rank sends nothing: c.skip (a refused call: c.reason), a combine with no dispatch of its own before
// it on this GPU (ERR_ORDER: a graph replayed out of order; `again`: the caller found this dispatch combined
// already), a bound_m other than the dispatched m (ERR_M_DIFFERS) or out of range (m_in_range: above c.rows,
// the fewest rows of the call's per-token arrays; ERR_BAD_M), or a dispatch
// whose receive half failed (`bad_recv`, state[BAD_RECV], which the next dispatch_send clears). `m`: the rows
// this rank may combine, 0 where there is a reason or its dispatch failed (state[M] invalid: dispatch_send
// reported it). Block 0's thread 0 records the bound_m errors (the call number `epoch`) and zeroes the next
// call's token claims (combine_recv's streamed form).
struct CombineCheck {
  int m;
  unsigned reason, bad_recv;
  bool failed;  // this rank's part of the call failed (a reason, or its dispatch failed): m is 0
};
__device__ __forceinline__ CombineCheck combine_check(const Fixed& f, const Call& c, unsigned epoch,
                                                      bool again = false) {
  const int m = c.skip ? 0 : *c.bound_m;
  const unsigned dispatched = f.state[MOECOMM_S_M];
  // this call's dispatch has not run, or (`again`, the local path's) its combine has: replayed out of order
  const bool order = !c.skip && (f.state[MOECOMM_S_EPOCH_DS] != epoch || again);
  const bool differs = !c.skip && !order && dispatched != M_INVALID && m != (int)dispatched;
  const bool short_rows = !c.skip && !order && !differs && dispatched != M_INVALID
      && !m_in_range(m, c.rows, f.max_tokens);
  const unsigned bad_recv = f.state[MOECOMM_S_BAD_RECV];
  const unsigned reason = c.skip ? (unsigned)c.reason
      : order ? (unsigned)MOECOMM_ERR_ORDER
      : differs ? (unsigned)MOECOMM_ERR_M_DIFFERS : short_rows ? (unsigned)MOECOMM_ERR_BAD_M : bad_recv;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    f.state[MOECOMM_S_TOKENS_EVEN + (epoch + 1) % 2] = 0;
    if (order) record_error(f.err, MOECOMM_ERR_ORDER, f.rank, MOECOMM_PHASE_COMBINE, 0, (int)epoch);
    if (differs) record_error(f.err, MOECOMM_ERR_M_DIFFERS, f.rank, MOECOMM_PHASE_COMBINE, m, (int)epoch);
    if (short_rows)
      record_error(f.err, MOECOMM_ERR_BAD_M, f.rank, MOECOMM_PHASE_COMBINE, m, (int)epoch, min(c.rows, f.max_tokens));
  }
  const bool failed = !c.skip && (reason || dispatched == M_INVALID);
  return {failed ? 0 : m, reason, bad_recv, failed};
}

// Combine's expert ids of this rank's share of the tokens t < m against those its dispatch read (f.ids_of), a
// pair per thread of the grid, strided: the thread's first pair is loaded at construction, before m is known
// (any row below c.rows is readable), so that differ(), at the end of the thread's work, seldom waits.
struct IdsCheck {
  int p, given, dispatched;
  __device__ __forceinline__ IdsCheck(const Fixed& f, const Call& c) : p(blockIdx.x * blockDim.x + threadIdx.x) {
    load(f, c, min(c.rows, f.max_tokens));
  }
  __device__ __forceinline__ int token(const Fixed& f) const { return f.rank % f.dp + p / f.topk * f.dp; }
  __device__ __forceinline__ void load(const Fixed& f, const Call& c, int below) {
    const int t = token(f);
    given = dispatched = 0;
    if (t < below) {
      const size_t pair = (size_t)t * f.topk + p % f.topk;
      given = expert_id(c, pair, f.num_experts);
      dispatched = f.ids_of[pair];
    }
  }
  // whether an id of the thread's pairs of tokens t < m differs
  __device__ __forceinline__ bool differ(const Fixed& f, const Call& c, int m) {
    bool d = false;
    for (; token(f) < m; p += gridDim.x * blockDim.x) {
      d |= given != dispatched;
      load(f, c, m);  // the next pair
    }
    return d;
  }
};

// True in every thread of the block that finishes last. All threads call it after their work (threads that
// put have completed their puts: quiet). One fence per block, by thread 0 after a barrier: the barrier makes
// every thread's writes observed by thread 0, whose fence is cumulative (the pattern of cooperative groups'
// grid sync, and of NCCL's primitives before a flag). `system`: the block's writes include stores to peers,
// which the last block's signals must follow (a fence per thread measured 2-5 us at decode sizes).
// count_block is thread 0's part: its release covers its own writes and those it has observed. Release and
// acquire only (no sequentially consistent fence, which __threadfence is: MEMBAR.SC.GPU): at GPU scope the
// count is one acquire-release atomic (one MEMBAR.ALL.GPU before it, the L1 invalidated after it); at system
// scope the release is a system fence, the last block's acquire a GPU-scope fence (the other blocks' writes
// were made visible at system scope, which includes the GPU).
// A block may also flag something (count_block: thread 0's `flag`; last_block: any thread's): the flag travels
// in the count's high bits (FLAGGED per flagged block; every grid is smaller: gpu_plan.py checks it), so that
// the last block learns whether any block flagged (`any`) from the count itself, with no load after it.
constexpr unsigned FLAGGED = MOECOMM_MAX_GRID_BLOCKS;
__device__ __forceinline__ bool count_block(unsigned* done, bool system, bool flag = false, bool* any = nullptr) {
  const unsigned add = flag ? 1u + FLAGGED : 1u;
  unsigned before;
  if (system) {
    fence_system();
    before = atomicAdd(done, add);
    if ((before & (FLAGGED - 1)) == gridDim.x - 1) asm volatile("fence.acq_rel.gpu;" ::: "memory");
  } else {
    asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], %2;" : "=r"(before) : "l"(done), "r"(add) : "memory");
  }
  if (any) *any = before + add >= FLAGGED;
  return (before & (FLAGGED - 1)) == gridDim.x - 1;
}
__device__ __forceinline__ bool last_block(unsigned* done, bool system, bool flag = false, bool* any = nullptr) {
  __shared__ bool last, flagged;
  const bool block_flag = __syncthreads_or(flag);  // any thread's: the block's flag
  if (threadIdx.x == 0) last = count_block(done, system, block_flag, &flagged);
  __syncthreads();
  if (any) *any = flagged;
  return last;
}

// Arrival words of a sending block (f.streamed, f.comb_streamed): each row it stores into a mapped rank is
// followed by a word there set to the call, released in batches of rows (ARRIVAL_FIRST, then twice as many
// each time up to ARRIVAL_BATCH): a release is a fence, which waits until the block's stores are
// acknowledged (one per row stalls the sends), and small first batches let the receivers start early. Warp 0
// lists the words of the row it routes in words[list]; once a batch is stored, the block's last warp
// (RELEASER) releases that list at the top of the next row, beside warp 0's routing of it, so the fence's
// wait is off the block's path, while warp 0 fills the other list. A block with no full batch leaves its
// words to its signal. Every thread keeps the counts alike; in the pipelined send (dispatch_send<true>) warp 0
// keeps its count a row ahead (it calls stored() as it routes a row), so the list it fills is never the one
// being released as long as every batch after the first has two rows or more.
constexpr int RELEASER = THREADS / 32 - 1;
static_assert(ARRIVAL_BATCH >= 2, "the pipelined send fills one list while the other is released (Arrivals)");
struct Arrivals {
  uint64_t* (*words)[ARRIVAL_BATCH * MAX_FANOUT];  // shared [2][...]
  int held = 0, batched = 0, batch = MOECOMM_ARRIVAL_FIRST, list = 0, pending = 0;
  bool released = false;
  // warp 0, routing a row: its i-th word
  __device__ __forceinline__ uint64_t*& word(int i) { return words[list][held + i]; }
  // every thread, after the barrier that ends a row's stores: n words were listed for it
  __device__ __forceinline__ void stored(int n) {
    held += n;
    if (++batched < batch) return;
    pending = held;
    held = batched = 0;
    list ^= 1;
    released = true;
    batch = min(2 * batch, ARRIVAL_BATCH);
  }
  // every thread, at the top of the next row: the full list, if any
  __device__ __forceinline__ void release_pending(unsigned epoch) {
    if (pending && (int)(threadIdx.x >> 5) == RELEASER) release(words[list ^ 1], pending, epoch);
    pending = 0;
  }
  // every thread, after the block's last row (and a barrier after its stores)
  __device__ __forceinline__ void release_last(unsigned epoch) {
    if (!released || (int)(threadIdx.x >> 5) != RELEASER) return;
    release(words[list ^ 1], pending, epoch);
    release(words[list], held, epoch);
  }
  // the block's stores so far (observed through a barrier: the fence is cumulative), then the n words
  static __device__ __forceinline__ void release(uint64_t* const* w, int n, unsigned epoch) {
    if (n && (threadIdx.x & 31) == 0) {
      fence_system();
      for (int j = 0; j < n; ++j) store_relaxed(w[j], epoch);
    }
  }
};

// Wait (bounded) until sig's epoch reaches `epoch` (the call number); returns the signal, or 0 after a
// timeout or abort.
__device__ __forceinline__ uint64_t wait_epoch(const Fixed& f, const uint64_t* sig, unsigned epoch, uint64_t deadline,
                                               int peer, int phase) {
  uint64_t v;
  for (unsigned spin = 1; ((v = load_acquire(sig)) >> 32) < epoch; ++spin)
    if (give_up(spin, deadline, f.err, f.gone, peer, phase, (int)epoch)) return 0;  // timed out, or another wait did
  return v;
}

// A peer's signal flagged SIG_BAD: record its reason (and the detail it wrote to why[peer] before the
// signal), unless this rank's own call is a skipped one (it has raised its own error) or the signal is
// this rank's own (it recorded its error itself).
__device__ __forceinline__ void peer_failed(const Fixed& f, const Call& c, uint64_t v, int peer, int phase,
                                            unsigned epoch) {
  if ((v & SIG_BAD) && !c.skip && peer != f.rank) {
    const int reason = (int)(v & SIG_REASON);
    const int amount = (reason & 0xff) == MOECOMM_ERR_CAPACITY ? (int)load_acquire(&f.why[peer]) : 0;
    record_error(f.err, MOECOMM_ERR_PEER, peer, phase, reason, (int)epoch, amount);
  }
}

__device__ __forceinline__ uint64_t epoch_signal(unsigned epoch, uint64_t payload) {
  return ((uint64_t)epoch << 32) | payload;
}

// A combine signal's low bits: OK and whether the sender's combine was given no router weights (partial sums:
// c.partials), which every rank's must match; or SIG_BAD | reason.
__device__ __forceinline__ uint64_t combine_signal(unsigned epoch, const Call& c, unsigned reason) {
  return epoch_signal(epoch, reason ? SIG_BAD | reason : 1u | (unsigned)c.partials << 1);
}

// A dispatch signal: the call, the expert-map generation, the record count.
__device__ __forceinline__ uint64_t count_signal(unsigned epoch, unsigned count, unsigned generation) {
  return epoch_signal(epoch, ((generation & SIG_GEN) << MOECOMM_SIG_COUNT_BITS) | count);
}

// The record count of this rank's own dispatch signal (0 when its sends failed).
__device__ __forceinline__ unsigned own_count(uint64_t v) { return v & SIG_BAD ? 0 : (unsigned)v & SIG_COUNT; }

// The send half's start and end, in dispatch_send and the local path's small batches (local.cu).
// dispatch_begin, every thread: the call's m (0 for a skipped call or an m out of range: ERR_BAD_M), block 0
// recording it for combine (state[M]) and the call's errors. dispatch_sent, every thread of the half's last
// block: each rank's signal (the call, its record count, or SIG_BAD with the call's error), then the per-call
// state reset; `local` also ends the receive half first (dispatch_counts) and stores the signal without a
// release; `own_records` >= 0: this rank's own record count (else its slot atomics' count, state[FIXED + rank]).
__device__ __forceinline__ int dispatch_begin(const Fixed& f, const Call& c, unsigned epoch) {
  const int m = c.skip ? 0 : *c.bound_m;
  const bool first = blockIdx.x == 0 && threadIdx.x == 0;
  // the previous call's combine, loaded beside m (a volatile load stays here): this thread routes a token next
  const unsigned combined = first ? (unsigned)load_volatile((const int*)&f.state[MOECOMM_S_EPOCH_CS]) : 0u;
  const bool bad_m = !m_in_range(m, c.rows, f.max_tokens);
  if (first) {
    f.state[MOECOMM_S_M] = bad_m ? M_INVALID : (unsigned)m;  // combine checks its bound_m against it
    f.state[MOECOMM_S_BAD_RECV] = 0;  // the previous call's (its combine has read it; the receive half sets it)
    if (!c.skip && combined != epoch - 1)  // the previous call's combine has not run
      record_error(f.err, MOECOMM_ERR_ORDER, f.rank, MOECOMM_PHASE_DISPATCH, 0, (int)epoch);
    if (c.skip) {
      if (c.reason) atomicCAS(&f.state[MOECOMM_S_BAD], 0u, (unsigned)c.reason);
    } else if (bad_m) {
      record_error(f.err, MOECOMM_ERR_BAD_M, f.rank, MOECOMM_PHASE_DISPATCH, m, (int)epoch, min(c.rows, f.max_tokens));
      atomicCAS(&f.state[MOECOMM_S_BAD], 0u, (unsigned)MOECOMM_ERR_BAD_M);
    }
  }
  return bad_m ? 0 : m;
}

// The word a dispatch leaves in every peer's f.ids[me] before its signal: the call and the program's call_id
// (0xffffffff where the call gives none); a receiver's own must equal it (receive(), dispatch_recv.cu).
__device__ __forceinline__ uint64_t call_id_word(const Call& c, unsigned epoch) {
  return (uint64_t)epoch << 32 | (c.call_id ? (unsigned)*c.call_id : 0xffffffffu);
}

__device__ __forceinline__ void dispatch_sent(const Fixed& f, const Call& c, unsigned epoch, bool local,
                                              int own_records) {
  TRACE_LAST_START();
  const unsigned bad = (unsigned)load_volatile((const int*)&f.state[MOECOMM_S_BAD]);
  const unsigned generation = f.state[MOECOMM_S_GEN];
  const bool self_masked = f.mask[f.rank];  // loaded beside the rest (the local path's only signal is its own)
  // the receive half's end, with no records: its counts' atomics issued first (nobody waits for the signal)
  if (local) dispatch_counts(f, c, f.state[MOECOMM_S_EPOCH_DR] + 1);
  for (int d = threadIdx.x; d < f.world; d += blockDim.x) {
    const unsigned cnt =
        d == f.rank && own_records >= 0 ? (unsigned)own_records : atomicExch(&f.state[MOECOMM_S_FIXED + d], 0u);
    const uint64_t word = bad ? epoch_signal(epoch, SIG_BAD | bad) : count_signal(epoch, cnt, generation);
    const bool masked = d == f.rank ? self_masked : f.mask[d];
    if (!masked && local) f.sig[f.rank] = word;  // read by later kernels only (world size 1): no release
    else if (!masked) {
      word_set(f.peers, &f.ids[f.rank], call_id_word(c, epoch), d);  // published by the signal's release
      signal_set(f.peers, &f.sig[f.rank], word, d);
    }
    if (d != f.rank) tally_bytes(f, MOECOMM_B_DISPATCH_SENT, d, (unsigned long long)cnt * f.rec_bytes);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (bad) f.state[MOECOMM_S_M] = M_INVALID;  // nothing of this rank's tokens comes back: combine writes nothing
    f.state[MOECOMM_S_BAD] = 0;
    f.state[MOECOMM_S_DONE_DS] = 0;
    f.state[MOECOMM_S_EPOCH_DS] = epoch;
  }
  TRACE_LAST(MOECOMM_TRACE_DISPATCH_SEND);
}

// 8 values of the output dtype in 16 bytes <-> float.
__device__ __forceinline__ void to_float8(const int4& v, int code, float* f) {
  if (code == MOECOMM_DT_BF16) {
    const __nv_bfloat162* h = (const __nv_bfloat162*)&v;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 t = __bfloat1622float2(h[i]);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  } else {
    const __half2* h = (const __half2*)&v;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 t = __half22float2(h[i]);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  }
}

__device__ __forceinline__ int4 from_float8(const float* f, int code) {
  int4 v;
  if (code == MOECOMM_DT_BF16) {
    __nv_bfloat162* h = (__nv_bfloat162*)&v;
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  } else {
    __half2* h = (__half2*)&v;
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
  }
  return v;
}

// The FP8 combine wire (f.wire): a row of f.hidden e4m3 values (8 bytes per 8 values), then at byte f.hidden
// a scale per MOECOMM_COMBINE_BLOCK values, float32 (WIRE_E4M3) or one UE8M0 byte (WIRE_E4M3_UE8M0), the row
// padded to f.comb_row_bytes. A block's value v stands for v * scale; the rounding is moecomm.reference's
// quantize_e4m3, operation for operation (no fused multiply-add on these paths: the reference rounds each step).
constexpr int WIRE_CHUNKS = MOECOMM_COMBINE_BLOCK / 8;  // 8-value chunks per scale

__device__ __forceinline__ float wire_scale(const Fixed& f, const uint8_t* row, int chunk) {
  const int b = chunk / WIRE_CHUNKS;
  if (f.wire == MOECOMM_WIRE_E4M3) return ((const float*)(row + f.hidden))[b];
  const unsigned e = row[f.hidden + b];  // 2^(e - 127); e = 0 is 2^-127, a float32 subnormal
  return __uint_as_float(e ? e << 23 : 0x400000u);
}

// 8 values of a row at chunk c as float: dtype `code` (MOECOMM_DT_BF16 / FP16: 16 bytes), or e4m3 (8 bytes)
// times its scale.
template <bool Wire>
__device__ __forceinline__ int4 load_chunk(const uint8_t* row, int c) {
  if (Wire) {
    const int2 v = ((const int2*)row)[c];
    return make_int4(v.x, v.y, 0, 0);
  }
  return ((const int4*)row)[c];
}

template <bool Wire>
__device__ __forceinline__ void chunk_to_float(const Fixed& f, const int4& v, float scale, float* out, int code) {
  if (!Wire) return to_float8(v, code, out);
  const unsigned words[2] = {(unsigned)v.x, (unsigned)v.y};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __half2 h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(words[i / 2] >> 16 * (i % 2)), __NV_E4M3);
    const float2 t = __half22float2(h);
    out[2 * i] = __fmul_rn(t.x, scale);
    out[2 * i + 1] = __fmul_rn(t.y, scale);
  }
}

// V float values a (8: chunk c of a row; 16: chunks 2p, 2p + 1) as e4m3 (q: V bytes) with the scale of their block
// of MOECOMM_COMBINE_BLOCK values, absmax / E4M3_MAX (1 for zeros; `pow2`: rounded up to a power of two), which it
// returns: the MOECOMM_COMBINE_BLOCK / V lanes that hold one block (aligned in the warp) call this together.
// moecomm.reference.quantize_e4m3, operation for operation.
template <int V>
__device__ __forceinline__ float quantize(const float* a, bool pow2, unsigned* q) {
  constexpr int LANES = MOECOMM_COMBINE_BLOCK / V;
  static_assert(LANES >= 2 && LANES <= 16 && V % 4 == 0, "a block's lanes in one warp");
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < V; ++i) amax = fmaxf(amax, fabsf(a[i]));
  const unsigned group = ((1u << LANES) - 1) << (threadIdx.x & (32 - LANES));
#pragma unroll
  for (int o = LANES / 2; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(group, amax, o));
  float scale = amax > 0.0f ? __fdiv_rn(amax, MOECOMM_E4M3_MAX) : 1.0f;
  if (pow2) {  // up to a power of two: 2^ceil(log2(scale))
    int e;
    const float m = frexpf(scale, &e);  // scale = m * 2^e, m in [0.5, 1)
    scale = ldexpf(1.0f, m == 0.5f ? e - 1 : e);
  }
  const float inverse = __frcp_rn(scale);
#pragma unroll
  for (int i = 0; i < V / 4; ++i) {
    const unsigned lo = __nv_cvt_float2_to_fp8x2(
        make_float2(__fmul_rn(a[4 * i], inverse), __fmul_rn(a[4 * i + 1], inverse)), __NV_SATFINITE, __NV_E4M3);
    const unsigned hi = __nv_cvt_float2_to_fp8x2(
        make_float2(__fmul_rn(a[4 * i + 2], inverse), __fmul_rn(a[4 * i + 3], inverse)), __NV_SATFINITE, __NV_E4M3);
    q[i] = lo | hi << 16;
  }
  return scale;
}

// A power-of-two scale as its UE8M0 byte (2^-127: byte 0).
__device__ __forceinline__ uint8_t ue8m0_of(float scale) { return (uint8_t)(__float_as_uint(scale) >> 23); }

// 8 float values into chunk c of the nd rows dsts: dtype `code` (BF16 / FP16), or e4m3 with the scale of their block of
// MOECOMM_COMBINE_BLOCK values (quantize<8>: the 16 lanes of a half-warp hold one block, they all call this
// together), written by the block's first lane.
template <bool Wire>
__device__ __forceinline__ void store_chunk(const Fixed& f, const float* a, int c, uint8_t* const* dsts, int nd,
                                            int code) {
  if (!Wire) {
    const int4 o = from_float8(a, code);
    for (int d = 0; d < nd; ++d) ((int4*)dsts[d])[c] = o;
    return;
  }
  unsigned q[2];
  const float scale = quantize<8>(a, f.wire == MOECOMM_WIRE_E4M3_UE8M0, q);
  const bool first = c % WIRE_CHUNKS == 0;
  for (int d = 0; d < nd; ++d) {
    ((int2*)dsts[d])[c] = make_int2((int)q[0], (int)q[1]);
    if (!first) continue;
    if (f.wire == MOECOMM_WIRE_E4M3) ((float*)(dsts[d] + f.hidden))[c / WIRE_CHUNKS] = scale;
    else dsts[d][f.hidden + c / WIRE_CHUNKS] = ue8m0_of(scale);
  }
}

// Scale i of a quantised token row into a scale row: a record's (row-major), or `output` one of c.out_scale at
// scale_row(): float32 (f.quant FLOAT, POW2) or a UE8M0 byte (UE8M0: one a byte, or four an int32, first lowest),
// in the AllToAll's scale layout.
__device__ __forceinline__ void store_quant_scale(const Fixed& f, uint8_t* row, int i, float scale, bool output) {
  const bool column = output && f.scale_column;
  if (f.quant != MOECOMM_QUANT_UE8M0) {
    *(float*)(row + (column ? (size_t)i * f.cap * 4 : (size_t)i * 4)) = scale;
  } else {
    const size_t at = !column ? i : f.scale_item == 1 ? (size_t)i * f.cap : (size_t)(i / 4) * f.cap * 4 + i % 4;
    row[at] = ue8m0_of(scale);
  }
}

// RowCopy::store of a quantising dispatch's send side: the source row x (f.src_row_bytes of bf16 / fp16, its first
// INFLIGHT chunks per thread in v, in adjacent pairs) into the n destinations as e4m3 (f.x_bytes) with a scale per
// MOECOMM_COMBINE_BLOCK values (quantize<16>; f.quant: rounded up to a power of two unless FLOAT). A thread takes
// two adjacent 16-byte source chunks (16 values) at a time and stores their 16 e4m3 bytes as one chunk; 8 lanes
// hold a scale block (nthreads is a multiple of 8, tid % 8 == lane % 8, and hidden a multiple of COMBINE_BLOCK),
// whose first lane stores the scale.
__device__ __forceinline__ void store_quantised(const Fixed& f, const int4* v, uint8_t* const* xd, uint8_t* const* sd,
                                                int n, int outputs, const uint8_t* x, int tid, int nthreads) {
  constexpr int PAIRS = MOECOMM_COMBINE_BLOCK / 16;  // chunk pairs per scale
  const int pairs = f.src_row_bytes / 32;
  const bool pow2 = f.quant != MOECOMM_QUANT_FLOAT;
  for (int base = 0; base < pairs; base += INFLIGHT / 2 * nthreads) {
    int4 w[INFLIGHT];
#pragma unroll
    for (int u = 0; u < INFLIGHT; ++u) {
      const int p = base + tid + u / 2 * nthreads;
      if (p < pairs) w[u] = base ? ((const int4*)x)[2 * p + u % 2] : v[u];
    }
#pragma unroll
    for (int k = 0; k < INFLIGHT / 2; ++k) {
      const int p = base + tid + k * nthreads;
      if (p >= pairs) continue;  // the same in a scale block's 8 lanes
      float a[16];
      to_float8(w[2 * k], f.src_code, a);
      to_float8(w[2 * k + 1], f.src_code, a + 8);
      unsigned q[4];
      const float scale = quantize<16>(a, pow2, q);
      for (int j = 0; j < n; ++j) ((int4*)xd[j])[p] = make_int4((int)q[0], (int)q[1], (int)q[2], (int)q[3]);
      if (p % PAIRS == 0)
        for (int j = 0; j < n; ++j) store_quant_scale(f, sd[j], p / PAIRS, scale, j >= outputs);
    }
  }
}

// Block-wide (or by the block's threads tid = 0..nthreads-1): dsts[0..nd) = sum_j w[j] * rows[j] over n rows of
// f.hidden values, accumulated in float; only the 8-value chunks [from, to) of the rows where `to` is given (0:
// the whole row). Rows and destinations are in dtypes src_code and dst_code (MOECOMM_DT_BF16 / FP16; -1: the
// output dtype, f.out_code), or (SrcWire, DstWire) on the FP8 combine wire.
// Each thread handles two chunks at a time and loads them from Batch rows before accumulating, so up to
// 2 * Batch loads are in flight; a 14 KB bf16 row takes two such rounds per group of Batch rows.
// nthreads is a multiple of 16 and f.hidden of MOECOMM_COMBINE_BLOCK where a side is on the wire, so a
// half-warp's lanes hold the 16 chunks of one scale block together.
template <bool SrcWire, bool DstWire, int Batch = 4>
__device__ __forceinline__ void weighted_sum(const Fixed& f, const uint8_t* const* rows, const float* w, int n,
                                             uint8_t* const* dsts, int nd, int tid = threadIdx.x,
                                             int nthreads = THREADS, int from = 0, int to = 0, int src_code = -1,
                                             int dst_code = -1) {
  constexpr bool exact = SrcWire || DstWire;  // round each product and sum, as the reference does
  if (src_code < 0) src_code = f.out_code;
  if (dst_code < 0) dst_code = f.out_code;
  const int chunks = to ? to : f.hidden / 8;
  for (int c = from + tid; c < chunks; c += 2 * nthreads) {
    const int c1 = c + nthreads;
    const bool two = c1 < chunks;
    float a0[8] = {0, 0, 0, 0, 0, 0, 0, 0}, a1[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int j = 0; j < n; j += Batch) {
      int4 v0[Batch], v1[Batch];
      float s0[Batch], s1[Batch];
#pragma unroll
      for (int u = 0; u < Batch; ++u) {
        s0[u] = s1[u] = 1.0f;
        if (j + u < n) {
          v0[u] = load_chunk<SrcWire>(rows[j + u], c);
          if (SrcWire) s0[u] = wire_scale(f, rows[j + u], c);
          if (two) {
            v1[u] = load_chunk<SrcWire>(rows[j + u], c1);
            if (SrcWire) s1[u] = wire_scale(f, rows[j + u], c1);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < Batch; ++u) {
        if (j + u >= n) continue;
        float v[8];
        chunk_to_float<SrcWire>(f, v0[u], s0[u], v, src_code);
#pragma unroll
        for (int i = 0; i < 8; ++i)
          a0[i] = exact ? __fadd_rn(a0[i], __fmul_rn(w[j + u], v[i])) : a0[i] + w[j + u] * v[i];
        if (two) {
          chunk_to_float<SrcWire>(f, v1[u], s1[u], v, src_code);
#pragma unroll
          for (int i = 0; i < 8; ++i)
            a1[i] = exact ? __fadd_rn(a1[i], __fmul_rn(w[j + u], v[i])) : a1[i] + w[j + u] * v[i];
        }
      }
    }
    store_chunk<DstWire>(f, a0, c, dsts, nd, dst_code);
    if (two) store_chunk<DstWire>(f, a1, c1, dsts, nd, dst_code);
  }
}

}  // namespace moecomm
