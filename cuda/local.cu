// The local path: dispatch and combine at world size 1 in the padded layout, where every pair is this rank's
// own, so nothing is exchanged and no block waits for another (moecomm/_abi.py: local).
#include "alltoall.cuh"

using namespace moecomm;

// grid: any number of blocks. The send half alone (dispatch_send.cu: every token stored straight into its
// expert slots, a token per block, pipelined where a block has several), whose last block also ends the receive
// half (dispatch_counts): no signal is waited for.
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_dispatch_local(const Fixed f, const Call c) {
  TRACE_SPAN(MOECOMM_TRACE_DISPATCH_SEND, 0);
  dispatch_send<true>(f, c, gridDim.x, true);
  TRACE_SPAN(MOECOMM_TRACE_DISPATCH_SEND, 1);
}

// grid: any number of blocks. Each token's sum is formed straight from its expert rows in c.y, as combine_send
// and combine_recv would form and add its partial sum: its pairs' slots and dispatched weights from f.own_of
// (dispatch_send), or the weights of c.weights where the dispatch had none (c.partials 0). No partial sum,
// signal or grid-wide count: a block ends with its work. Work items, handed out strided: (token t < m, slice s
// of its row's 8-value chunks), `slices` per token so that a small batch fills the grid; the block's threads
// share a slice, all of a chunk's rows (up to 8) loaded before the first add; each warp lists the token's rows
// itself (no block barrier). Writes rows 0..m-1 of c.out_tokens [rows, hidden] out_dtype (a token with no row
// gets zeros) and, when given, c.out_dropped [rows, topk] uint8 (from f.drop_buf, which dispatch_send wrote);
// nothing where combine_check leaves no rows. The call number is the dispatch's: every block stores it as the
// combine's (no block of this call reads it); state[BAD_RECV] is cleared by the next dispatch_send.
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_combine_local(const Fixed f, const Call c) {
  TRACE_SPAN(MOECOMM_TRACE_COMBINE_SEND, 0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned epoch = f.state[MOECOMM_S_EPOCH_DS];
  const int m = combine_check(f, c, epoch).m;
  const int chunks = f.hidden / 8;
  const int slices = max(1, min((int)gridDim.x / max(m, 1), (chunks + 63) / 64));
  const int per = (chunks + slices - 1) / slices;
  __shared__ const uint8_t* rows[THREADS / 32][MOECOMM_MAX_TOPK];  // each warp's list of the token's rows
  __shared__ float wts[THREADS / 32][MOECOMM_MAX_TOPK];
  for (int i = blockIdx.x; i < m * slices; i += gridDim.x) {
    const int t = i / slices, s = i % slices;
    const size_t pair = (size_t)t * f.topk + lane;
    const int2 own = lane < f.topk ? f.own_of[pair] : make_int2(-1, 0);
    const float w = c.partials ? __int_as_float(own.y) : lane < f.topk ? c.weights[pair] : 0.0f;
    const unsigned use = __ballot_sync(FULL, own.x >= 0);
    if (own.x >= 0) {
      const int pos = __popc(use & ((1u << lane) - 1));
      rows[warp][pos] = c.y + (size_t)own.x * f.out_row_bytes;
      wts[warp][pos] = w;
    }
    if (c.out_dropped && s == 0 && warp == 0 && lane < f.topk) {
      const uint64_t d = f.drop_buf ? f.drop_buf[(size_t)f.rank * f.max_tokens + t] : 0;
      c.out_dropped[pair] = (unsigned)(d >> 32) == epoch && ((d >> lane) & 1);
    }
    __syncwarp();
    uint8_t* const dst = c.out_tokens + (size_t)t * f.out_row_bytes;
    weighted_sum<false, false, 8>(f, rows[warp], wts[warp], __popc(use), &dst, 1, threadIdx.x, THREADS, s * per,
                                  min(chunks, (s + 1) * per));
    __syncwarp();  // the list is rewritten for the next item
  }
  if (threadIdx.x == 0) f.state[MOECOMM_S_EPOCH_CS] = epoch;
  TRACE_SPAN(MOECOMM_TRACE_COMBINE_SEND, 1);
}
