// Gradients along a routing plan (moecomm.AllToAll.plan, dispatch_backward, combine_backward): the plan of the
// last dispatch as data, and the two backward operations, exchanges of gradient rows that follow a plan, not
// the forward's call state (so they may run after other calls, and in any order).
//
// Wire: rows of f.grad_buf, f.grad_row_bytes each (moecomm/_abi.py, grad_row_bytes): hidden values in the row's
// dtype (the sender's gradient dtype, or float32 for a partial sum), the token's router weights
// (combine_backward), then a trailer int4 {call, dtype code}. A row counts only when its trailer holds the
// call, so nothing is cleared between calls. Both operations use row (sending rank * max_tokens + token).
// What a rank's own tokens need from its own expert slots never passes through the buffers: the plan's `local`
// names those slots, and each side reads the other's arrays where they are.
//   dispatch_backward  the expert side sends one row per (token, expert rank) to every other rank of the
//                      token's DP group: a token's one slot there as it is, or the float32 sum of its slots
//                      there (the forward combine's partial sums); the token side sums, in float32, its own
//                      slots (plan.local) and the rows that came.
//   combine_backward   the token side sends grad_out[t] with its weights once to each other expert rank of its
//                      pairs; the expert side writes each slot's gradient (weight * row) and sends <row,
//                      expert_y[slot]> back as one word per pair, f.grad_w[t * topk + k] = (call << 32 | float
//                      bits), to the source's DP group (to its own tokens' out_grad_weights directly).
// Completion: f.grad_sig[0][q] (rows from rank q) and f.grad_sig[1][q] (router weights' gradients from q) =
// (call << 32 | q's plan word), or SIG_BAD | reason where q's part failed; the plan words let every rank check
// that all follow the plan of the same dispatch (ERR_PLAN_DIFFERS). A rank writes into a peer's grad_buf only
// once that peer has read the previous backward call's rows: f.grad_sig[2][q] holds the last call q finished.
// Calls of both operations are counted in state[EPOCH_B] on the device, so CUDA graphs replay them.
// Kernels: moecomm_plan (and moecomm_source_layout: the slots by source); each operation in one launch of a grid
// resident at once, in parts that follow each other through those signals (dispatch_backward: send, receive;
// combine_backward: send, the expert side, receive). A rank waits only for the signals of ranks whose rows or words
// it reads (its own where the DP group has other ranks), and does the work that needs none first: its own tokens
// whose pairs are all on this rank, its own tokens' slots. The blocks count each part in a counter of its own
// (state[DONE_B0 + part]), and a part's last block signals (with one rank, only the last part is counted: nobody
// waits for the others).
// At world size 1 in the padded layout each operation has a local kernel instead (the end of this file).
// When a backward call fails (on any rank), what it writes is unspecified: its outputs may be partly written.
#include "alltoall.cuh"

using namespace moecomm;

namespace {

constexpr int TRAILER = 16;

__device__ __forceinline__ int value_bytes(int code) { return code == MOECOMM_DT_FP32 ? 4 : 2; }

// 8 values of a row of dtype `code` (MOECOMM_DT_*) from value 8 * c, as float; and back.
__device__ __forceinline__ void load8(const uint8_t* row, int code, int c, float* v) {
  if (code != MOECOMM_DT_FP32) return to_float8(((const int4*)row)[c], code, v);
  const float4 a = ((const float4*)row)[2 * c], b = ((const float4*)row)[2 * c + 1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

__device__ __forceinline__ void store8(uint8_t* row, int code, int c, const float* v) {
  if (code != MOECOMM_DT_FP32) {
    ((int4*)row)[c] = from_float8(v, code);
    return;
  }
  ((float4*)row)[2 * c] = make_float4(v[0], v[1], v[2], v[3]);
  ((float4*)row)[2 * c + 1] = make_float4(v[4], v[5], v[6], v[7]);
}

// The plan's call as its signals carry it (moecomm/_constants.py, PLAN_CALL_BITS); 0 for a skipped call
// (it has no plan).
__device__ __forceinline__ unsigned plan_word(const Grad& g) {
  if (g.skip) return 0;
  return ((unsigned)g.call[0] & ((1u << MOECOMM_PLAN_GEN_BITS) - 1)) << MOECOMM_PLAN_CALL_BITS |
         ((unsigned)g.call[1] & ((1u << MOECOMM_PLAN_CALL_BITS) - 1));
}

// This rank's part of the call failed (`reason`): its signals flag it, and it writes nothing more.
__device__ __forceinline__ void fail(const Fixed& f, unsigned reason) {
  atomicCAS(&f.state[MOECOMM_S_BAD_B], 0u, reason);
}

// Every thread: wait (bounded) for every unmasked rank's word in `sig` ([world]) of call `epoch`, this rank's
// own only with `self`. A peer that failed, or (`check`) follows another plan than `mine`, is recorded. True in
// every thread when all is well.
__device__ bool heard(const Fixed& f, const uint64_t* sig, unsigned epoch, unsigned mine, bool check, int phase,
                      bool self) {
  const uint64_t deadline = now_ns() + f.timeout_ns;
  bool ok = true;
  for (int q = threadIdx.x; q < f.world; q += blockDim.x) {
    if (f.mask[q] || (q == f.rank && !self)) continue;
    const uint64_t v = wait_epoch(f, &sig[q], epoch, deadline, q, phase);
    if (!v) {
      ok = false;  // timed out (recorded)
    } else if (v & SIG_BAD) {
      ok = false;
      if (check && q != f.rank) record_error(f.err, MOECOMM_ERR_PEER, q, phase, (int)(v & SIG_REASON), (int)epoch);
    } else if (check && (unsigned)v != mine) {
      ok = false;
      record_error(f.err, MOECOMM_ERR_PLAN_DIFFERS, q, phase, (int)(unsigned)v, (int)epoch, (int)mine);
    }
  }
  return __syncthreads_and(ok);
}

// Block-wide: put a staged row (tg.staged) to tg's put targets, its bytes [from, to) and its part from `tail`
// on (weights, trailer). Not inlined (as put_block_all): NVSHMEM's put path would take registers from the sums.
static __device__ __noinline__ void put_row(const Targets& tg, int from, int to, int tail, int row_bytes) {
  for (int j = 0; j < tg.n_put; ++j) {
    put_block(tg.remote[j] + from, tg.staged + from, to - from, tg.pes[j]);
    put_block(tg.remote[j] + tail, tg.staged + tail, row_bytes - tail, tg.pes[j]);
  }
}

// Block-wide, after the row's bytes [from, to) are in tg.dsts: its trailer, then the puts of a staged row: those
// bytes, and its weights with the trailer.
__device__ void finish_row(const Fixed& f, const Targets& tg, int from, int to, unsigned epoch, int code) {
  if (threadIdx.x == 0)
    for (int j = 0; j < tg.n; ++j)
      *(int4*)(tg.dsts[j] + f.grad_row_bytes - TRAILER) = make_int4((int)epoch, code, 0, 0);
  if (!tg.n_put) return;
  __syncthreads();  // the staged row is complete
  put_row(tg, from, to, 4 * f.hidden, f.grad_row_bytes);
}

// Block-wide: chunks c0 .. c1-1 (8 values each) of rows dsts[0..nd) (dtype out_code) = the float32 sum of rows
// srcs[0..n) (dtype codes[j]), BATCH rows' loads in flight before the adds (8, R1: all of a token's rows; 2 in
// the local path's float32 case, beside weighted_sum's registers). Not inlined: its loads take the registers
// that the callers' NVSHMEM paths hold.
template <int BATCH = 8>
static __device__ __noinline__ void sum_rows(uint8_t* const* dsts, int nd, int out_code, const uint8_t* const* srcs,
                                             const int* codes, int n, int c0, int c1) {
  for (int c = c0 + threadIdx.x; c < c1; c += THREADS) {
    float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int j = 0; j < n; j += BATCH) {
      float v[BATCH][8];
#pragma unroll
      for (int u = 0; u < BATCH; ++u)
        if (j + u < n) load8(srcs[j + u], codes[j + u], c, v[u]);
#pragma unroll
      for (int u = 0; u < BATCH; ++u)
        if (j + u < n)
#pragma unroll
          for (int i = 0; i < 8; ++i) a[i] += v[u][i];
    }
    for (int d = 0; d < nd; ++d) store8(dsts[d], out_code, c, a);
  }
}

// Received record i (of source rank i / max_tokens) of the last dispatch: whether it holds a token (this rank's
// own: as many as its dispatch signal counts, as combine_send reads them), and that token in `t`.
__device__ __forceinline__ bool received_token(const Fixed& f, int i, int& t) {
  const int q = i / f.max_tokens, j = i % f.max_tokens;
  const unsigned count = q == f.rank && !f.packed ? own_count(load_acquire(&f.sig[f.rank])) : f.state[f.s_recv + q];
  if (j >= (int)count) return false;
  t = meta_of(f.recv_buf + (size_t)i * f.rec_bytes, f)[0];
  return true;
}

// How many slots the plan holds (g.held[0], bounded by the slots); g.held[1 ..] lists them.
__device__ __forceinline__ int held_count(const Grad& g) { return min(max(g.held[0], 0), g.slots); }

// (source rank, token, k) of held slot `s` as the plan's origin has them; false (and q = -1) unless they name a
// pair of this AllToAll (a slot out of range, an empty slot: not a plan of this AllToAll's).
__device__ __forceinline__ bool pair_at(const Fixed& f, const Grad& g, int s, int& q, int& t, int& k) {
  q = t = k = -1;
  if (s < 0 || s >= g.slots) return false;
  q = g.origin[3 * s], t = g.origin[3 * s + 1], k = g.origin[3 * s + 2];
  return q >= 0 && q < f.world && t >= 0 && t < f.max_tokens && k >= 0 && k < f.topk;
}

// Group starts find_groups examines at a time: a group (at most topk <= MOECOMM_MAX_TOPK slots) that starts
// among them ends within the warp's 32 positions.
constexpr int GROUP_WINDOW = 32 - MOECOMM_MAX_TOPK;

// Warp 0 (every lane): the groups of g.held (n entries) that start at positions i .. min(i + GROUP_WINDOW,
// end) - 1. A group is the held slots of one (source rank, token), consecutive in g.held (moecomm_plan lists a
// record's slots together). Their first positions, sizes, source ranks and tokens go to first / size / src /
// tok (shared), their count to *count; a slot that names no pair, or a group of more than topk slots (not a
// plan of this AllToAll's), is a group of source -1.
__device__ void find_groups(const Fixed& f, const Grad& g, int i, int end, int n, int* first, int* size, int* src,
                            int* tok, int* count) {
  const int lane = threadIdx.x & 31, p = i + lane;
  auto key = [&](int at) {  // (source rank, token) of held position `at` as one number, unique where none
    int q, t, k;
    return pair_at(f, g, g.held[1 + at], q, t, k) ? (long long)q * f.max_tokens + t : -2ll - at;
  };
  const long long mine = p < n ? key(p) : -1;
  long long before = __shfl_up_sync(FULL, mine, 1);
  if (lane == 0) before = p > 0 ? key(p - 1) : -1;
  const bool starts = p >= n || mine != before;
  const unsigned bounds = __ballot_sync(FULL, starts);
  const bool take = starts && p < end && lane < GROUP_WINDOW;
  const unsigned taken = __ballot_sync(FULL, take);
  if (take) {
    const unsigned later = bounds & ~((2u << lane) - 1);  // the starts after this one
    const int at = __popc(taken & ((1u << lane) - 1)), len = later ? __ffs(later) - 1 - lane : 32 - lane;
    int q, t, k;
    const bool valid = pair_at(f, g, g.held[1 + p], q, t, k) && len <= f.topk;
    first[at] = p;
    size[at] = len;
    src[at] = valid ? q : -1;
    tok[at] = t;
  }
  if (lane == 0) *count = __popc(taken);
}

// The last block of a part: set this rank's word `sig` ([world]: index rank) on every unmasked rank.
__device__ void signal_all(const Fixed& f, uint64_t* sig, uint64_t v) {
  for (int q = threadIdx.x; q < f.world; q += blockDim.x)
    if (!f.mask[q]) signal_set(f.peers, &sig[f.rank], v, q);
  __syncthreads();
}

// Every thread, at the end of part `part` (0, 1, 2) of the kernel: true in the part's last block (counted in
// state[DONE_B0 + part], which it resets for the next call; `system`: the blocks' writes include peers').
__device__ bool part_last(const Fixed& f, int part, bool system = true) {
  unsigned* const done = &f.state[MOECOMM_S_DONE_B0 + part];
  if (!last_block(done, system)) return false;
  if (threadIdx.x == 0) *done = 0;
  return true;
}

// Every thread, at the end of part `part` (but the last): the part's last block sets this rank's word of `sig`
// ([world]) on every unmasked rank: the call with SIG_BAD | reason where this rank's call failed, else `word`.
// With one rank nobody waits for the word, and the part is not counted.
__device__ void part_done(const Fixed& f, int part, uint64_t* sig, unsigned epoch, uint64_t word) {
  if (f.world == 1 || !part_last(f, part)) return;
  const unsigned bad = (unsigned)load_volatile((const int*)&f.state[MOECOMM_S_BAD_B]);
  signal_all(f, sig, epoch_signal(epoch, bad ? SIG_BAD | bad : word));
}

// What every block of a backward call knows from its start (begin): the call, and m where this rank's part of
// it runs with data (`ok`: not skipped, m in range; else m is 0).
struct Begun {
  unsigned epoch;
  int m;
  bool ok;
};

}  // namespace

// grid: any number of blocks. The plan of the last dispatch (the host cleared g.origin and g.local to -1 and
// g.held[0] to 0 first): g.expert [max_tokens, topk] = f.sent for this rank's tokens of its DP group below the
// dispatched m, else -1; g.origin[slot] = (source rank, token, k) of each slot f.slot_of holds, from the records
// received (this rank's own: as many as its dispatch signal counts; combine_send reads them alike), and those
// slots listed in g.held (a record's together, the records in any order: find_groups); g.local[t * topk + k] =
// the slot of this rank's own pair (t, k); g.call = (g.generation, the dispatch's call).
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_plan(const Fixed f, const Grad g) {
  after_previous_kernel();
  const unsigned dispatched = f.state[MOECOMM_S_M];
  const int m = dispatched == M_INVALID ? 0 : (int)dispatched;
  const int tid = blockIdx.x * blockDim.x + threadIdx.x, all = gridDim.x * blockDim.x;
  for (int i = tid; i < f.max_tokens * f.topk; i += all) {
    const int t = i / f.topk;
    g.expert[i] = t < m && t % f.dp == f.rank % f.dp ? f.sent[i] : -1;
  }
  const int lane = threadIdx.x & 31, records = f.world * f.max_tokens;
  for (int i0 = tid - lane; i0 < records; i0 += all) {  // warp-uniform: the warp's 32 records at a time
    const int i = i0 + lane, q = i / f.max_tokens;
    int t = 0;
    const bool live = i < records && received_token(f, i, t);
    const int* const slots = f.slot_of + (size_t)i * f.topk;
    int n = 0;  // this record's slots, then a place for them in g.held: one atomic per warp
    for (int k = 0; live && k < f.topk; ++k) n += slots[k] >= 0;
    int before = n;  // inclusive prefix over the lanes
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(FULL, before, o);
      if (lane >= o) before += v;
    }
    const int total = __shfl_sync(FULL, before, 31);
    int first = 0;
    if (lane == 0 && total) first = atomicAdd(g.held, total);
    first = __shfl_sync(FULL, first, 0) + before - n;
    for (int k = 0; live && k < f.topk; ++k) {
      const int s = slots[k];
      if (s < 0) continue;
      g.origin[3 * s] = q;
      g.origin[3 * s + 1] = t;
      g.origin[3 * s + 2] = k;
      g.held[1 + first++] = s;
      if (q == f.rank && t >= 0 && t < f.max_tokens) g.local[t * f.topk + k] = s;
    }
  }
  if (tid == 0) {
    g.call[0] = g.generation;
    g.call[1] = (int)f.state[MOECOMM_S_EPOCH_DS];
  }
}

// grid: 1 block (with no plan: any AllToAll in the padded layout whose experts' slots are grouped by source,
// AllToAllConfig.slots_by_source). Where the last dispatch put each source rank's rows (moecomm.AllToAll.source_layout;
// DeepEP's low-latency handle): s.src_info [local_experts * cap] = the token (its row on its source rank) of
// each slot, -1 where empty; s.layout_range [local_experts, world] int64 = (first slot << 32) | slots from that
// source (consecutive), 0 where none; s.add_counts [local_experts] int32 (or null) += each expert's slots written
// (DeepEP's cumulative receive statistics). The counts and first slots gather in layout_range's two 32-bit halves.
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_source_layout(const Fixed f, const Sources s) {
  after_previous_kernel();
  const int slots = f.local_experts * f.cap, ranges = f.local_experts * f.world;
  unsigned* const range = reinterpret_cast<unsigned*>(s.layout_range);  // [ranges][count, first]: little-endian
  for (int i = threadIdx.x; i < slots; i += blockDim.x) s.src_info[i] = -1;
  for (int i = threadIdx.x; i < ranges; i += blockDim.x) range[2 * i] = 0, range[2 * i + 1] = 0xFFFFFFFFu;
  __syncthreads();
  for (int i = threadIdx.x; i < f.world * f.max_tokens; i += blockDim.x) {
    int t;
    if (!received_token(f, i, t)) continue;
    const int q = i / f.max_tokens;
    for (int k = 0; k < f.topk; ++k) {
      const int slot = f.slot_of[(size_t)i * f.topk + k];
      if (slot < 0 || slot >= slots) continue;
      s.src_info[slot] = t;
      unsigned* const r = &range[2 * ((slot / f.cap) * f.world + q)];
      atomicAdd(&r[0], 1u);
      atomicMin(&r[1], (unsigned)(slot % f.cap));
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < ranges; i += blockDim.x)
    if (range[2 * i] == 0) range[2 * i + 1] = 0;
  if (s.add_counts)
    for (int e = threadIdx.x; e < f.local_experts; e += blockDim.x) {
      int slots = 0;
      for (int q = 0; q < f.world; ++q) slots += (int)range[2 * (e * f.world + q)];
      s.add_counts[e] += slots;
    }
}

// grid: world * parts blocks (the ranks layout, f.packed == PACK_RANKS). Each received row's routing
// (moecomm.AllToAll.row_routing; DeepEP's recv_topk_idx and recv_topk_weights), between the dispatch's receive half
// and its combine: block b reads source b % world's records (record pairs b / world, then every parts-th block's
// share), whose row dispatch_recv's place_rows left in f.slot_of's lane 0; r.indices [cap, topk] (int64 where
// r.idx64, else int32) gets the record's expert ids as this rank's local experts (-1 elsewhere) and r.weights
// [cap, topk] float32 (or null) the dispatched weights there (0 elsewhere); every row past the received ones
// (the sources' counts summed) gets -1 and 0.
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_row_routing(const Fixed f, const RowRouting r) {
  after_previous_kernel();
  const int src = blockIdx.x % f.world, part = blockIdx.x / f.world, parts = gridDim.x / f.world;
  const int lo = f.rank * f.local_experts;
  auto put = [&](size_t at, int le, float w) {
    if (r.idx64) static_cast<long long*>(r.indices)[at] = le;
    else static_cast<int*>(r.indices)[at] = le;
    if (r.weights) r.weights[at] = w;
  };
  const int pairs = (int)f.state[f.s_recv + src] * f.topk;
  for (int i = part * blockDim.x + threadIdx.x; i < pairs; i += parts * blockDim.x) {
    const int k = i % f.topk;
    const size_t j = (size_t)src * f.max_tokens + i / f.topk;
    const int row = f.slot_of[j * f.topk];
    if (row < 0 || row >= f.cap) continue;
    const int* meta = meta_of(f.recv_buf + j * f.rec_bytes, f);
    const int le = meta[1 + k] - lo;
    const bool mine = meta[1 + k] >= 0 && le >= 0 && le < f.local_experts;
    put((size_t)row * f.topk + k, mine ? le : -1, mine ? ((const float*)meta)[1 + f.topk + k] : 0.0f);
  }
  int rows = 0;
  for (int s = 0; s < f.world; ++s) rows += (int)f.state[f.s_recv + s];
  for (int i = rows * f.topk + blockIdx.x * blockDim.x + threadIdx.x; i < f.cap * f.topk;
       i += gridDim.x * blockDim.x)
    put((size_t)i, -1, 0.0f);
}

namespace {

// Every block, first: the call, m, and whether m is in range (ERR_BAD_M: block 0 records it).
__device__ Begun begin(const Fixed& f, const Grad& g, int phase) {
  const unsigned epoch = f.state[MOECOMM_S_EPOCH_B] + 1;
  const int m = g.skip ? 0 : *g.bound_m;
  const bool bad_m = !g.skip && !m_in_range(m, g.rows, f.max_tokens);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    if (g.skip) {
      fail(f, g.reason ? (unsigned)g.reason : (unsigned)MOECOMM_ERR_REFUSED);
    } else if (bad_m) {
      record_error(f.err, MOECOMM_ERR_BAD_M, f.rank, phase, m, (int)epoch, min(g.rows, f.max_tokens));
      fail(f, MOECOMM_ERR_BAD_M);
    }
  }
  const bool ok = !g.skip && !bad_m;
  return Begun{epoch, ok ? m : 0, ok};
}

// Block 0, where this rank's part runs with data: the plan's pairs for tokens >= m, which make it another call's
// plan (ERR_PLAN_M).
__device__ void check_plan_m(const Fixed& f, const Grad& g, const Begun& b, int phase) {
  if (blockIdx.x != 0 || !b.ok) return;
  bool extra = false;
  for (int i = b.m * f.topk + threadIdx.x; i < f.max_tokens * f.topk; i += blockDim.x) extra |= g.expert[i] >= 0;
  if (__syncthreads_or(extra) && threadIdx.x == 0) {
    record_error(f.err, MOECOMM_ERR_PLAN_M, f.rank, phase, b.m, (int)b.epoch);
    fail(f, MOECOMM_ERR_PLAN_M);
  }
}

// The send part of both operations (every block of the call's launch, part 0), after the checks of this rank's
// m (begin) and plan (pairs for tokens >= m: ERR_PLAN_M, block 0), once each peer has read the last call's rows.
// Dispatch (expert side): each group of g.held (a token's slots on this rank, find_groups) sends one row of
// g.grad ([slots, hidden], g.grad_code) to the other ranks of its source's DP group: the slot's gradient as it
// is when the group has one slot, else the group's sum in float32 (this rank's own tokens read their slots in
// place: token_side). Combine (token side): each token t < m of this rank's DP share sends g.grad[t] ([rows,
// hidden]) and g.weights[t] to the other ranks of its experts in g.expert (masked ranks skipped; expert_part
// reads them in place for this rank's own experts). Ends with f.grad_sig[0][me] on every unmasked rank.
template <bool Dispatch>
__device__ void send_part(const Fixed& f, const Grad& g, const Begun& b) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned epoch = b.epoch;
  const int phase = Dispatch ? MOECOMM_PHASE_DISPATCH_BACKWARD : MOECOMM_PHASE_COMBINE_BACKWARD;
  const int m = b.m;
  const bool send = b.ok;
  check_plan_m(f, g, b, phase);
  const uint64_t deadline = now_ns() + f.timeout_ns;
  for (int q = threadIdx.x; q < f.world; q += blockDim.x)  // each peer's buffer is free once it read the last call
    if (send && q != f.rank && !f.mask[q])
      wait_epoch(f, &f.grad_sig[2 * f.world + q], epoch - 1, deadline, q, phase);
  __syncthreads();
  __shared__ uint8_t* dsts[MAX_FANOUT];
  __shared__ uint8_t* remote[MAX_FANOUT];
  __shared__ int pes[MAX_FANOUT];
  __shared__ int ranks[MOECOMM_MAX_TOPK];
  __shared__ int n_ranks;
  Targets tg{dsts, remote, pes};
  Stage st(f);
  const int bytes = f.hidden * value_bytes(g.grad_code);
  if (send && Dispatch) {
    __shared__ int first[GROUP_WINDOW], size[GROUP_WINDOW], src[GROUP_WINDOW], tok[GROUP_WINDOW];
    __shared__ int n_groups;
    __shared__ const uint8_t* srcs[MOECOMM_MAX_TOPK];
    __shared__ int codes[MOECOMM_MAX_TOPK];
    // the grid as ranges of g.held in `parts` blocks each, a block per part of a row's chunks (8 values), so that
    // a small batch fills the grid (parts as if every group had topk slots)
    const int n = held_count(g), chunks = f.hidden / 8;
    const int parts = max(1, min((int)gridDim.x * f.topk / max(n, 1), chunks / 32)), range = blockIdx.x / parts;
    const int per = (n + gridDim.x / parts - 1) / (gridDim.x / parts), per_part = (chunks + parts - 1) / parts;
    const int begin = min(n, range * per), end = min(n, begin + per);
    const int c0 = blockIdx.x % parts * per_part, c1 = min(chunks, c0 + per_part);
    for (int i = begin; i < end; i += GROUP_WINDOW) {
      __syncthreads();  // the group lists are rewritten
      if (warp == 0) find_groups(f, g, i, end, n, first, size, src, tok, &n_groups);
      __syncthreads();
      for (int j = 0; j < n_groups; ++j) {
        const int p = first[j], slots = size[j], q = src[j], t = tok[j];
        if (q < 0) {
          if (threadIdx.x == 0 && c0 == 0) {
            record_error(f.err, MOECOMM_ERR_PLAN_DIFFERS, f.rank, phase, -2, (int)epoch, g.held[1 + p]);
            fail(f, MOECOMM_ERR_PLAN_DIFFERS);
          }
          continue;
        }
        if (q == f.rank && f.dp == 1) continue;  // this rank's own token, and nobody else's: token_side sums it
        __syncthreads();  // srcs may still be read for the previous group
        if (threadIdx.x < slots) {
          srcs[threadIdx.x] = g.grad + (size_t)g.held[1 + p + threadIdx.x] * bytes;
          codes[threadIdx.x] = g.grad_code;
        }
        // one slot travels as it is, a sum in float32
        const int code = slots == 1 ? g.grad_code : MOECOMM_DT_FP32, item = value_bytes(code);
        uint8_t* const row = f.grad_buf + ((size_t)f.rank * f.max_tokens + t) * f.grad_row_bytes;
        const int group0 = q / f.dp * f.dp, group1 = group0 + f.dp;
        for (int q0 = group0; q0 < group1; q0 += MOECOMM_MAX_TOPK) {  // the group in batches of the fan-out
          __syncthreads();
          if (threadIdx.x == 0) {
            int n_in = 0;
            for (int r = q0; r < min(group1, q0 + MOECOMM_MAX_TOPK); ++r)
              if (!f.mask[r] && (r != f.rank || q != f.rank)) ranks[n_in++] = r;  // own tokens: recv in place
            n_ranks = n_in;
          }
          __syncthreads();
          if (!n_ranks) continue;
          tg.start();
          for (int j = 0; j < n_ranks; ++j) tg.add(f.peers, row, ranks[j]);
          tg.finish(st);
          sum_rows(tg.dsts, tg.n, code, srcs, codes, slots, c0, c1);
          finish_row(f, tg, 8 * item * c0, 8 * item * c1, epoch, code);
        }
      }
    }
  } else if (send) {
    for (int t = f.rank % f.dp + blockIdx.x * f.dp; t < m; t += gridDim.x * f.dp) {
      __syncthreads();  // ranks and n_ranks are rewritten
      if (warp == 0) {  // the distinct unmasked ranks of the token's pairs
        const int e = lane < f.topk ? g.expert[(size_t)t * f.topk + lane] : -1;
        int d = e >= 0 && e < f.world * f.local_experts ? e / f.local_experts : -1;
        if (d >= 0 && (f.mask[d] || d == f.rank)) d = -1;  // this rank's expert side reads g.grad in place
        const bool once = first_of(d) && d >= 0;
        const unsigned mask = __ballot_sync(FULL, once);
        if (once) ranks[__popc(mask & ((1u << lane) - 1))] = d;
        if (lane == 0) n_ranks = __popc(mask);
      }
      __syncthreads();
      if (!n_ranks) continue;
      uint8_t* const row = f.grad_buf + ((size_t)f.rank * f.max_tokens + t) * f.grad_row_bytes;
      tg.start();
      for (int j = 0; j < n_ranks; ++j) tg.add(f.peers, row, ranks[j]);
      tg.finish(st);
      fanout16(tg.dsts, tg.n, g.grad + (size_t)t * bytes, bytes);
      if (threadIdx.x < f.topk) {
        const float w = g.weights[(size_t)t * f.topk + threadIdx.x];
        for (int j = 0; j < tg.n; ++j) ((float*)(tg.dsts[j] + 4 * f.hidden))[threadIdx.x] = w;
      }
      finish_row(f, tg, 0, bytes, epoch, g.grad_code);
    }
  }
  if (st.used_puts) quiet();
  part_done(f, 0, f.grad_sig, epoch, plan_word(g));
}

// Slots combine_backward's expert side takes at a time per block (slot_pass).
constexpr int SLOT_BATCH = 8;

// combine_backward's expert side, one pass over the slots the plan holds (g.held, a slot per block, strided):
// with `own`, those of this rank's own tokens below b.m, else the others. Each gets g.out[slot] = weight * row
// ([slots, hidden], g.out_code; empty slots are left as they are) and sends <row, g.y[slot]> (summed in float32)
// as the pair's word of f.grad_w to the source's DP group; this rank's own pairs read g.grad[t] and
// g.weights[t] where they are and store their word's value into g.out_w[t * topk + k] ([rows, topk]) directly.
// Warp 0 reads the plan entries, trailers and weights of SLOT_BATCH slots at once, and their words go out
// together after the batch. A source whose row did not come (the ranks' plans differ) is recorded
// (ERR_PLAN_DIFFERS, detail -1). True in every thread when the block's share holds slots of the other pass.
__device__ bool slot_pass(const Fixed& f, const Grad& g, const Begun& b, bool own) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int phase = MOECOMM_PHASE_COMBINE_BACKWARD;
  const unsigned epoch = b.epoch;
  const int out_bytes = f.hidden * value_bytes(g.out_code), row_chunks = out_bytes / 16;
  // the batch's slots (-1: none), pairs (source rank, token, k), row dtypes (-1: the row did not come), weights,
  // and the warps' parts of each slot's dot product
  __shared__ int b_slot[SLOT_BATCH], b_src[SLOT_BATCH], b_tok[SLOT_BATCH], b_k[SLOT_BATCH], b_code[SLOT_BATCH];
  __shared__ const uint8_t* b_row[SLOT_BATCH];
  __shared__ float b_w[SLOT_BATCH], partial[SLOT_BATCH][THREADS / 32];
  const int n = b.ok ? held_count(g) : 0, m = b.m;
  bool other = false;  // warp 0: a slot of the other pass was seen
  for (int i0 = blockIdx.x; i0 < n; i0 += gridDim.x * SLOT_BATCH) {
    __syncthreads();  // the batch's entries are rewritten
    if (warp == 0 && lane < SLOT_BATCH) {
      const int i = i0 + lane * gridDim.x;
      int s = -1, q = 0, t = 0, k = 0, code = -1;
      float w = 0.0f;
      const uint8_t* row = nullptr;
      if (i < n) {
        s = g.held[1 + i];
        const bool in_range = pair_at(f, g, s, q, t, k);
        const bool valid = in_range && !f.mask[q];  // a masked source's pair gets zeros
        if ((valid && q == f.rank && t < m) != own) {
          other = true;
          s = -1;
        } else if (own) {  // this rank's own token: its gradient and weights where they are
          code = g.grad_code;
          row = g.grad + (size_t)t * f.hidden * value_bytes(code);
          w = g.weights[(size_t)t * f.topk + k];
        } else if (valid && q != f.rank) {
          row = f.grad_buf + ((size_t)q * f.max_tokens + t) * f.grad_row_bytes;
          const int4 trailer = *(const int4*)(row + f.grad_row_bytes - TRAILER);
          if ((unsigned)trailer.x == epoch && trailer.y >= 0 && trailer.y <= MOECOMM_DT_FP32) {
            code = trailer.y;
            w = ((const float*)(row + 4 * f.hidden))[k];
          }
        }
        if (s >= 0 && code < 0 && (valid || !in_range)) {  // the plans differ, or this one is not a plan
          record_error(f.err, MOECOMM_ERR_PLAN_DIFFERS, in_range ? q : f.rank, phase, in_range ? -1 : -2, (int)epoch,
                       s);
          fail(f, MOECOMM_ERR_PLAN_DIFFERS);
        }
        if (s >= g.slots) s = -1;
      }
      b_slot[lane] = s, b_src[lane] = q, b_tok[lane] = t, b_k[lane] = k, b_code[lane] = code, b_w[lane] = w;
      b_row[lane] = row;
    }
    __syncthreads();
    for (int j = 0; j < SLOT_BATCH; ++j) {
      const int s = b_slot[j], code = b_code[j];
      if (s < 0) continue;
      uint8_t* const out = g.out + (size_t)s * out_bytes;
      if (code < 0) {
        for (int c = threadIdx.x; c < row_chunks; c += THREADS) ((int4*)out)[c] = make_int4(0, 0, 0, 0);
        continue;
      }
      const uint8_t* const row = b_row[j];
      const uint8_t* const y = g.y + (size_t)s * f.out_row_bytes;
      const float w = b_w[j];
      float dot = 0.0f;
      constexpr int AHEAD = 4;  // chunks of the row and of y loaded before any is used (R1: the whole row)
      for (int c0 = threadIdx.x; c0 < f.hidden / 8; c0 += THREADS * AHEAD) {
        float v[AHEAD][8];
        int4 u[AHEAD];
#pragma unroll
        for (int a = 0; a < AHEAD; ++a) {
          const int c = c0 + THREADS * a;
          if (c < f.hidden / 8) {
            load8(row, code, c, v[a]);
            u[a] = ((const int4*)y)[c];
          }
        }
#pragma unroll
        for (int a = 0; a < AHEAD; ++a) {
          const int c = c0 + THREADS * a;
          if (c >= f.hidden / 8) continue;
          float yv[8];
          to_float8(u[a], f.out_code, yv);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            dot += v[a][e] * yv[e];
            v[a][e] *= w;
          }
          store8(out, g.out_code, c, v[a]);
        }
      }
      for (int o = 16; o; o >>= 1) dot += __shfl_xor_sync(FULL, dot, o);
      if (lane == 0) partial[j][warp] = dot;
    }
    __syncthreads();
    if (warp == 0 && lane < SLOT_BATCH && b_slot[lane] >= 0 && b_code[lane] >= 0) {  // the batch's words
      float sum = 0.0f;
      for (int j = 0; j < THREADS / 32; ++j) sum += partial[lane][j];
      const size_t pair = (size_t)b_tok[lane] * f.topk + b_k[lane];
      if (own) g.out_w[pair] = sum;
      const uint64_t v = epoch_signal(epoch, __float_as_uint(sum));
      const int group0 = b_src[lane] / f.dp * f.dp;
      for (int r = group0; r < group0 + f.dp; ++r) {  // stored relaxed: the part's signal releases them all
        if (f.mask[r] || (own && r == f.rank)) continue;
        if (uint64_t* const p = peer_ptr(f.peers, &f.grad_w[pair], r)) store_relaxed(p, v);
        else signal_set(f.peers, &f.grad_w[pair], v, r);
      }
    }
  }
  return __syncthreads_or(other);
}

// combine_backward's expert side (every block, part 1): slot_pass over this rank's own tokens' slots, which need
// no signal, then, once every other unmasked rank's rows have come (f.grad_sig[0]; this rank writes none into
// its own buffer), over the others. Ends with f.grad_sig[1][me] on every unmasked rank.
__device__ void expert_part(const Fixed& f, const Grad& g, const Begun& b) {
  for (int pass = 0; pass < 2; ++pass) {  // one loop, not two calls: the pass's code once (registers)
    const bool others = slot_pass(f, g, b, pass == 0);
    // every block hears the peers here, before any later wait: a rank that never came is the one a timeout names
    if (pass == 0 && (!heard(f, f.grad_sig, b.epoch, plan_word(g), !g.skip, MOECOMM_PHASE_COMBINE_BACKWARD, false) ||
                      !others))
      break;
  }
  part_done(f, 1, f.grad_sig + f.world, b.epoch, plan_word(g));
}

// One unit of dispatch_backward's token side: chunks c0 .. c1-1 (8 values each) of g.out[t] ([rows, hidden],
// g.out_code) = the float32 sum of this rank's own slots of token t (g.local: rows of g.grad, g.grad_code) and,
// with `rows`, of the token's rows of this call in f.grad_buf (one per rank that sent one: by trailer).
__device__ void sum_token(const Fixed& f, const Grad& g, unsigned epoch, int t, int c0, int c1, bool rows) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __shared__ const uint8_t* srcs[MOECOMM_MAX_TOPK];
  __shared__ int codes[MOECOMM_MAX_TOPK];
  __shared__ int n;
  __shared__ uint8_t* out[1];
  if (warp == 0) {
    int found = 0;
    if (t % f.dp == f.rank % f.dp) {  // this rank's own token: its slots here (a lane per pair)
      const int s = lane < f.topk ? g.local[(size_t)t * f.topk + lane] : -1;
      const bool use = s >= 0 && s < g.slots;
      const unsigned mask = __ballot_sync(FULL, use);
      if (use) {
        const int pos = __popc(mask & ((1u << lane) - 1));
        srcs[pos] = g.grad + (size_t)s * f.hidden * value_bytes(g.grad_code);
        codes[pos] = g.grad_code;
      }
      found = __popc(mask);
    }
    for (int e0 = 0; rows && e0 < f.world; e0 += 32) {  // the rows of this call, a lane per rank
      const int e = e0 + lane;
      const uint8_t* const row = f.grad_buf + ((size_t)e * f.max_tokens + t) * f.grad_row_bytes;
      const int4 trailer = e < f.world ? *(const int4*)(row + f.grad_row_bytes - TRAILER) : make_int4(0, 0, 0, 0);
      const bool use = e < f.world && (unsigned)trailer.x == epoch && trailer.y >= 0 && trailer.y <= MOECOMM_DT_FP32;
      const unsigned mask = __ballot_sync(FULL, use);
      const int pos = found + __popc(mask & ((1u << lane) - 1));
      if (use && pos < MOECOMM_MAX_TOPK) {  // at most topk ranks hold a token's pairs
        srcs[pos] = row;
        codes[pos] = trailer.y;
      }
      found += __popc(mask);
    }
    if (lane == 0) {
      n = min(found, MOECOMM_MAX_TOPK);
      out[0] = g.out + (size_t)t * f.hidden * value_bytes(g.out_code);
    }
  }
  __syncthreads();
  sum_rows(out, 1, g.out_code, srcs, codes, n, c0, c1);
  __syncthreads();  // srcs, codes, n and out are rewritten
}

// dispatch_backward's token side (every block, part 1): rows 0..b.m-1 of g.out, as units of (token, piece of
// its row) so that a batch smaller than the grid fills it (sum_token). The tokens whose pairs all went to this
// rank's experts first, from its own slots alone; the others once every unmasked rank that sends this rank
// rows has signalled (f.grad_sig[0]; this rank's own only where its DP group has other ranks). Rows >= m are
// left as they are.
__device__ void token_side(const Fixed& f, const Grad& g, const Begun& b) {
  const int chunks = f.hidden / 8, m = b.m;
  const int parts = max(1, min((int)gridDim.x / max(m, 1), chunks / 32)), per = (chunks + parts - 1) / parts;
  const int units = m * parts;
  auto sum_unit = [&](int unit, bool rows) {
    const int t = unit / parts, piece = unit % parts;
    sum_token(f, g, b.epoch, t, piece * per, min(chunks, (piece + 1) * per), rows);
  };
  // bit j: the block's unit j (blockIdx.x + j * gridDim.x, j < 32) is such a token: a thread per pair
  __shared__ unsigned local_units;
  const int j = threadIdx.x / f.topk, unit = blockIdx.x + j * gridDim.x, t = unit / parts;
  const bool listed = j < 32 && unit < units && t % f.dp == f.rank % f.dp;
  if (threadIdx.x == 0) local_units = 0;
  __syncthreads();
  if (listed && threadIdx.x % f.topk == 0) atomicOr(&local_units, 1u << j);
  __syncthreads();
  if (listed) {
    const int e = g.expert[(size_t)t * f.topk + threadIdx.x % f.topk];
    if (e >= 0 && e / f.local_experts != f.rank) atomicAnd(&local_units, ~(1u << j));
  }
  __syncthreads();
  const unsigned local = local_units;
  for (unsigned left = local; left; left &= left - 1) sum_unit(blockIdx.x + (__ffs(left) - 1) * gridDim.x, false);
  if (!heard(f, f.grad_sig, b.epoch, plan_word(g), !g.skip, MOECOMM_PHASE_DISPATCH_BACKWARD, f.dp > 1)) return;
  for (int i = 0, u = blockIdx.x; u < units; ++i, u += gridDim.x)
    if (i >= 32 || !(local >> i & 1)) sum_unit(u, true);
}

// combine_backward's receive part (every block, part 2): rows 0..b.m-1 of g.out_w ([rows, topk] float32). Of
// this rank's own tokens, the pairs with a slot here (g.local) were written by the expert side, and the others
// that were not sent or have no slot on this rank's experts (dropped there) get 0 at once; the rest, once
// every unmasked rank that sends this rank words has signalled (f.grad_sig[1]; this rank's own only where its
// DP group has other ranks), get their word of f.grad_w of this call, else 0. Rows >= m are left as they are.
__device__ void weight_side(const Fixed& f, const Grad& g, const Begun& b) {
  const int first = blockIdx.x * blockDim.x + threadIdx.x, all = gridDim.x * blockDim.x, pairs = b.m * f.topk;
  auto here = [&](int i) {  // 1: this rank's own pair with a slot here, -1: its own with none, 0: a word's
    if (i / f.topk % f.dp != f.rank % f.dp) return 0;
    const int e = g.expert[i];
    return g.local[i] >= 0 ? 1 : e < 0 || e / f.local_experts == f.rank ? -1 : 0;
  };
  for (int i = first; i < pairs; i += all)
    if (here(i) < 0) g.out_w[i] = 0.0f;
  const bool ok = heard(f, f.grad_sig + f.world, b.epoch, plan_word(g), !g.skip, MOECOMM_PHASE_COMBINE_BACKWARD,
                        f.dp > 1);
  for (int i = first; ok && i < pairs; i += all) {
    if (here(i)) continue;
    const uint64_t v = load_acquire(&f.grad_w[i]);
    g.out_w[i] = (unsigned)(v >> 32) == b.epoch ? __uint_as_float((unsigned)v) : 0.0f;
  }
}

// The end of both operations (every block, after the last part, `part`): this rank has read every row and
// word of the call, so its buffer is free: f.grad_sig[2][me] = the call on every unmasked rank (not on the
// local path, `exchanged` false: nothing was exchanged, nobody waits); the call is counted in state[EPOCH_B]
// (every block read it in begin) and its failure reason reset.
__device__ void finish(const Fixed& f, int part, unsigned epoch, bool exchanged = true) {
  if (!part_last(f, part, exchanged)) return;
  if (exchanged) signal_all(f, f.grad_sig + 2 * f.world, epoch_signal(epoch, 1));
  if (threadIdx.x == 0) {
    f.state[MOECOMM_S_BAD_B] = 0;
    f.state[MOECOMM_S_EPOCH_B] = epoch;
  }
}

}  // namespace

// grid: _abi._gpu_blocks, resident at once (its parts wait for each other's signals). dispatch_backward:
// g.grad is grad_expert_x [slots, hidden], g.out out_grad_x [rows, hidden] (send_part, token_side).
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_dispatch_backward(const Fixed f, const Grad g) {
  after_previous_kernel();
  const Begun b = begin(f, g, MOECOMM_PHASE_DISPATCH_BACKWARD);
  send_part<true>(f, g, b);
  token_side(f, g, b);
  finish(f, 1, b.epoch);
}

// grid: as moecomm_dispatch_backward. combine_backward: g.grad is grad_out [rows, hidden], g.weights
// [rows, topk], g.y expert_y [slots, hidden], g.out out_grad_expert_y [slots, hidden], g.out_w
// out_grad_weights [rows, topk] (send_part, expert_part, weight_side).
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_combine_backward(const Fixed f, const Grad g) {
  after_previous_kernel();
  const Begun b = begin(f, g, MOECOMM_PHASE_COMBINE_BACKWARD);
  send_part<false>(f, g, b);
  expert_part(f, g, b);
  weight_side(f, g, b);
  finish(f, 2, b.epoch);
}

// The local path (gpu_plan.py: local(), world size 1 in the padded layout): every pair is this rank's own, so
// nothing is exchanged and no block waits for another; both operations read the slots of plan.local, grids of
// any size, work items handed out strided, each block's first item's plan entries loaded beside begin's loads
// (the items are cut by the rows, min(g.rows, max_tokens), which m is at most once checked). What they check
// and write is what the operations above do there.

namespace {

// Rows of the call's per-token arrays that the local path may read before m is known.
__device__ __forceinline__ int rows_known(const Fixed& f, const Grad& g) {
  return g.skip ? 0 : min(g.rows, f.max_tokens);
}

// The slot `s` of plan.local as taken: -1 for none; a slot beyond the AllToAll's (not a plan of this
// AllToAll's) is recorded (ERR_PLAN_DIFFERS, detail -2) and taken as none.
__device__ __forceinline__ int local_slot(const Fixed& f, const Grad& g, const Begun& b, int s, int phase) {
  if (s >= -1 && s < g.slots) return s;
  record_error(f.err, MOECOMM_ERR_PLAN_DIFFERS, f.rank, phase, -2, (int)b.epoch, s);
  fail(f, MOECOMM_ERR_PLAN_DIFFERS);
  return -1;
}

}  // namespace

// grid: any number of blocks (gpu_plan.py: _sum_blocks). dispatch_backward as moecomm_combine_local sums:
// work items (token t < m, slice of its row's 8-value chunks), `slices` per token so that a small batch fills
// the grid; each warp lists the token's slots itself (no block barrier), then the block's threads share the
// slice: rows 0..m-1 of g.out (out_grad_x [rows, hidden], g.out_code) = the float32 sum of the token's slots'
// rows of g.grad (grad_expert_x [slots, hidden], g.grad_code), zeros for a token without one (weighted_sum
// for 16-bit dtypes, sum_rows where one is float32). Rows >= m are left as they are.
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_dispatch_backward_local(const Fixed f, const Grad g) {
  after_previous_kernel();
  const int phase = MOECOMM_PHASE_DISPATCH_BACKWARD;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, chunks = f.hidden / 8, rows = rows_known(f, g);
  const int most_slices = (chunks + MOECOMM_SUM_SLICE_CHUNKS - 1) / MOECOMM_SUM_SLICE_CHUNKS;
  const int slices = max(1, min((int)gridDim.x / max(rows, 1), most_slices)), per = (chunks + slices - 1) / slices;
  auto slot_of = [&](int i) {  // lane k: the slot of item i's token's k-th pair (plan.local)
    const int t = i / slices;
    return t < rows && lane < f.topk ? g.local[(size_t)t * f.topk + lane] : -1;
  };
  int slot = slot_of(blockIdx.x);
  const Begun b = begin(f, g, phase);
  check_plan_m(f, g, b, phase);
  const bool wide = g.grad_code != MOECOMM_DT_FP32 && g.out_code != MOECOMM_DT_FP32;  // weighted_sum's dtypes
  const size_t grad_bytes = (size_t)f.hidden * value_bytes(g.grad_code);
  __shared__ const uint8_t* srcs[THREADS / 32][MOECOMM_MAX_TOPK];  // each warp's list of the token's rows
  __shared__ float ones[MOECOMM_MAX_TOPK];
  __shared__ int codes[MOECOMM_MAX_TOPK];
  if (threadIdx.x < MOECOMM_MAX_TOPK) ones[threadIdx.x] = 1.0f, codes[threadIdx.x] = g.grad_code;
  __syncthreads();
  for (int i = blockIdx.x; i < b.m * slices; i += gridDim.x) {
    const int t = i / slices, s = i % slices;
    if (i != (int)blockIdx.x) slot = slot_of(i);
    slot = local_slot(f, g, b, slot, phase);
    const unsigned use = __ballot_sync(FULL, slot >= 0);
    if (slot >= 0) srcs[warp][__popc(use & ((1u << lane) - 1))] = g.grad + (size_t)slot * grad_bytes;
    __syncwarp();
    uint8_t* const dst = g.out + (size_t)t * f.hidden * value_bytes(g.out_code);
    const int c0 = s * per, c1 = min(chunks, c0 + per);
    if (wide)
      weighted_sum<false, false, 8>(f, srcs[warp], ones, __popc(use), &dst, 1, threadIdx.x, THREADS, c0, c1,
                                    g.grad_code, g.out_code);
    else
      sum_rows<2>(&dst, 1, g.out_code, srcs[warp], codes, __popc(use), c0, c1);
    __syncwarp();  // the list is rewritten for the next item
  }
  finish(f, 0, b.epoch, false);
}

// Pairs combine_backward's local path takes at a time, two 8-value chunks of each in flight per thread.
constexpr int PAIR_BATCH = 4;

// grid: any number of blocks (gpu_plan.py: _pair_blocks). combine_backward as moecomm_dispatch_tokens stores:
// work items (token t < m, part p of its pairs: k % parts == p), `parts` per token so that a small batch fills
// the grid. Warp 0 lists the item's pairs that hold a slot (plan.local) with their router weights (g.weights
// [rows, topk]); the block's threads then take 8-value chunks of g.grad[t] (grad_out [rows, hidden],
// g.grad_code) and of each slot's g.y row (expert_y [slots, hidden], f.out_code), PAIR_BATCH slots at a time:
// g.out[slot] (out_grad_expert_y [slots, hidden], g.out_code) = weight * grad_out[t], and the chunks' part of
// <grad_out[t], expert_y[slot]>, reduced over the block into g.out_w[t * topk + k] (out_grad_weights
// [rows, topk] float32). The item's pairs without a slot (-1 ids, dropped, masked) get 0. Rows >= m and empty
// slots are left as they are.
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_combine_backward_local(const Fixed f, const Grad g) {
  after_previous_kernel();
  const int phase = MOECOMM_PHASE_COMBINE_BACKWARD;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, chunks = f.hidden / 8, rows = rows_known(f, g);
  const int parts = max(1, min(f.topk, (int)gridDim.x / max(rows, 1)));
  bool ours = false;  // warp 0, lane k: whether item i takes its token's pair k, and the pair's slot and weight
  int slot = -1;
  float weight = 0.0f;
  auto pair_of = [&](int i) {
    const int t = i / parts, k = lane;
    const size_t pair = (size_t)t * f.topk + k;
    ours = t < rows && k < f.topk && k % parts == i % parts;
    slot = ours ? g.local[pair] : -1;
    weight = ours ? g.weights[pair] : 0.0f;
  };
  if (warp == 0) pair_of(blockIdx.x);
  const Begun b = begin(f, g, phase);
  check_plan_m(f, g, b, phase);
  const size_t grad_bytes = (size_t)f.hidden * value_bytes(g.grad_code);
  const size_t out_bytes = (size_t)f.hidden * value_bytes(g.out_code);
  __shared__ uint8_t* outs[MOECOMM_MAX_TOPK];
  __shared__ const uint8_t* ys[MOECOMM_MAX_TOPK];
  __shared__ float wts[MOECOMM_MAX_TOPK], partial[MOECOMM_MAX_TOPK][THREADS / 32];
  __shared__ int pairs[MOECOMM_MAX_TOPK], n;
  for (int i = blockIdx.x; i < b.m * parts; i += gridDim.x) {
    const int t = i / parts;
    __syncthreads();  // the previous item's list and partial sums are read
    if (warp == 0) {
      if (i != (int)blockIdx.x) pair_of(i);
      const size_t pair = (size_t)t * f.topk + lane;
      const int s = ours ? local_slot(f, g, b, slot, phase) : -1;
      const unsigned use = __ballot_sync(FULL, s >= 0);
      if (s >= 0) {
        const int pos = __popc(use & ((1u << lane) - 1));
        outs[pos] = g.out + (size_t)s * out_bytes;
        ys[pos] = g.y + (size_t)s * f.out_row_bytes;
        wts[pos] = weight;
        pairs[pos] = (int)pair;
      } else if (ours) {
        g.out_w[pair] = 0.0f;
      }
      if (lane == 0) n = __popc(use);
    }
    __syncthreads();
    const int count = n;
    const uint8_t* const grad = g.grad + (size_t)t * grad_bytes;
    for (int j0 = 0; j0 < count; j0 += PAIR_BATCH) {
      float dot[PAIR_BATCH] = {};
      for (int c = threadIdx.x; c < chunks; c += 2 * THREADS) {
        const int c1 = c + THREADS;
        const bool two = c1 < chunks;
        float x[2][8];
        int4 y[2][PAIR_BATCH];
        load8(grad, g.grad_code, c, x[0]);
        if (two) load8(grad, g.grad_code, c1, x[1]);
#pragma unroll
        for (int j = 0; j < PAIR_BATCH; ++j)
          if (j0 + j < count) {
            y[0][j] = ((const int4*)ys[j0 + j])[c];
            if (two) y[1][j] = ((const int4*)ys[j0 + j])[c1];
          }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (h && !two) break;
#pragma unroll
          for (int j = 0; j < PAIR_BATCH; ++j) {
            if (j0 + j >= count) continue;
            float v[8], o[8];
            to_float8(y[h][j], f.out_code, v);
            const float w = wts[j0 + j];
#pragma unroll
            for (int e = 0; e < 8; ++e) {
              dot[j] += x[h][e] * v[e];
              o[e] = w * x[h][e];
            }
            store8(outs[j0 + j], g.out_code, h ? c1 : c, o);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < PAIR_BATCH; ++j) {
        for (int o = 16; o; o >>= 1) dot[j] += __shfl_xor_sync(FULL, dot[j], o);
        if (lane == 0 && j0 + j < count) partial[j0 + j][warp] = dot[j];
      }
    }
    __syncthreads();
    if (threadIdx.x < count) {
      float sum = 0.0f;
      for (int w = 0; w < THREADS / 32; ++w) sum += partial[threadIdx.x][w];
      g.out_w[pairs[threadIdx.x]] = sum;
    }
  }
  finish(f, 0, b.epoch, false);
}
