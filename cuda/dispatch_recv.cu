// Dispatch, receive half: wait for every source rank, fan its records out to the local experts.
// This rank's own tokens were put in place by dispatch_send; their records are only counted here.
#include "alltoall.cuh"

using namespace moecomm;

// grid: world * parts blocks of MOECOMM_BLOCK_THREADS; block b serves source rank b % world, one block
// per record (strided); each record is read once and stored into every local expert it goes to.
// Reads f.recv_buf and f.sig (this rank's copies); writes c.out_num [local_experts] int32,
// c.out_x [local_experts, cap, hidden] in_dtype, c.out_scale [local_experts, cap, scales] float32 (or
// null), and f.slot_of [world, max_tokens, topk]: where record (src, j)'s k-th expert slot is (le*cap+slot,
// or -1). A masked source is not waited for and sends nothing; with c.skip (a refused call) the records
// are not unpacked and nothing is written (the epoch still advances, so the next call pairs up). A source
// whose signal carries another expert-map generation is not unpacked (ERR_GENERATION).
// Capacity: a pair past its expert's f.cap slots is not stored. f.drop: it is dropped and flagged to the
// token's rank in its f.drop_buf[me][token]; else the last block records ERR_CAPACITY with the expert's
// demand and state[BAD_RECV] makes combine_send flag the call to every peer.
// Packed layout (f.packed): records of every source, this rank's own included, get a slot within each
// local expert (slot_of) while the rank's rows last (f.cap, the same policies); nothing is copied here. The
// last block writes c.out_offsets (the experts' first rows) and dispatch_pack places the rows.
// Telemetry (last block): the call's demand per local expert into f.ring, tokens received and pairs
// dropped per expert; bytes received per source.
__device__ void moecomm::dispatch_recv(const Fixed& f, const Call& c) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  TRACE(MOECOMM_TRACE_DISPATCH_RECV, 0);
  const int src = blockIdx.x % f.world, part = blockIdx.x / f.world, parts = gridDim.x / f.world;
  const unsigned epoch = f.state[MOECOMM_S_EPOCH_DR] + 1;
  __shared__ unsigned count;
  __shared__ int n;
  __shared__ uint8_t* xdst[MOECOMM_MAX_TOPK];
  __shared__ uint8_t* sdst[MOECOMM_MAX_TOPK];
  if (threadIdx.x == 0) {
    const uint64_t v = f.mask[src] ? 0
        : wait_epoch(&f.sig[src], epoch, now_ns() + f.timeout_ns, f.err, src, MOECOMM_PHASE_DISPATCH);
    peer_failed(f, c, v, src, MOECOMM_PHASE_DISPATCH, epoch);
    count = (v & SIG_BAD) || c.skip ? 0 : (unsigned)v & SIG_COUNT;
    const unsigned theirs = ((unsigned)v >> MOECOMM_SIG_COUNT_BITS) & SIG_GEN;
    if (v && !(v & SIG_BAD) && !c.skip && theirs != (f.state[MOECOMM_S_GEN] & SIG_GEN)) {
      record_error(f.err, MOECOMM_ERR_GENERATION, src, MOECOMM_PHASE_DISPATCH, (int)theirs, (int)epoch,
                   (int)(f.state[MOECOMM_S_GEN] & SIG_GEN));
      count = 0;
    }
    if (count > (unsigned)f.max_tokens) {
      record_error(f.err, MOECOMM_ERR_OVERFLOW, src, MOECOMM_PHASE_DISPATCH, count, (int)epoch);
      count = 0;
    }
    if (part == 0) {
      f.state[f.s_recv + src] = count;
      if (src != f.rank)
        tally_bytes(f, MOECOMM_B_DISPATCH_RECEIVED, src, (unsigned long long)count * f.rec_bytes);
    }
  }
  __syncthreads();
  TRACE(MOECOMM_TRACE_DISPATCH_RECV, 1);
  const int lo = f.rank * f.local_experts;
  const int records = src == f.rank && !f.packed ? 0 : (int)count;
  bool flagged = false;  // this thread set drop words (completed before the block ends)
  for (int j = part; j < records; j += parts) {
    const uint8_t* rec = f.recv_buf + ((size_t)src * f.max_tokens + j) * f.rec_bytes;
    if (warp == 0) {  // a slot in each local expert of the record (in parallel lanes; id -1 is none)
      int where = -1;
      bool dropped = false;
      if (lane < f.topk) {
        const int le = meta_of(rec, f)[1 + lane] - lo;
        if (le >= 0 && le < f.local_experts) {
          const unsigned slot = atomicAdd(&f.state[f.s_expert + le], 1u);  // the expert's demand
          if (f.packed) {
            if (atomicAdd(&f.state[MOECOMM_S_ROWS], 1u) < (unsigned)f.cap)
              where = (int)atomicAdd(&f.state[f.s_kept + le], 1u);  // the row: dispatch_pack adds the offset
            else
              dropped = f.drop;
          } else if (slot < (unsigned)f.cap) {
            where = le * f.cap + slot;
          } else {
            dropped = f.drop;
          }
        }
        f.slot_of[((size_t)src * f.max_tokens + j) * f.topk + lane] = where;
      }
      const unsigned drops = __ballot_sync(FULL, dropped);
      if (drops && lane == 0) {  // tell the token's rank (read by its combine_recv after our combine signal)
        const int t = meta_of(rec, f)[0];
        signal_set(f.peers, &f.drop_buf[(size_t)f.rank * f.max_tokens + t], epoch_signal(epoch, drops), src);
        flagged = true;
      }
      if (!f.packed) list_rows(f, c, where, xdst, sdst, &n);  // packed: dispatch_pack places the rows
    }
    __syncthreads();
    if (j == part) TRACE(MOECOMM_TRACE_DISPATCH_RECV, 2);
    if (!f.packed) copy_record(f, xdst, sdst, n, rec);
    __syncthreads();
    if (j == part) TRACE(MOECOMM_TRACE_DISPATCH_RECV, 3);
  }
  if (flagged) quiet();  // drop words to peers without a mapping
  TRACE(MOECOMM_TRACE_DISPATCH_RECV, 4);
  const bool is_last = last_block(&f.state[MOECOMM_S_DONE_DR], f.drop);  // drop words to mapped peers
  TRACE(MOECOMM_TRACE_DISPATCH_RECV, 5);
  if (is_last) {
    TRACE_LAST_START();
    const size_t row = f.window ? (size_t)(f.counters[MOECOMM_C_CALLS] % f.window) * f.local_experts : 0;
    for (int le = threadIdx.x; le < f.local_experts; le += blockDim.x) {
      const unsigned demand = atomicExch(&f.state[f.s_expert + le], 0u);
      const unsigned kept = f.packed ? atomicExch(&f.state[f.s_kept + le], 0u) : min(demand, (unsigned)f.cap);
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
      if (over && !f.drop && !f.packed && atomicCAS(&f.state[MOECOMM_S_BAD_RECV], 0u,
                                   MOECOMM_ERR_CAPACITY | (lo + le + 1) << MOECOMM_REASON_ARG_SHIFT) == 0u) {
        f.state[MOECOMM_S_WHY] = demand;
        record_error(f.err, MOECOMM_ERR_CAPACITY, f.rank, MOECOMM_PHASE_DISPATCH, lo + le, (int)epoch, (int)demand);
      }
    }
    if (threadIdx.x == 0 && f.packed) {  // the rank's rows against its capacity ("error"; "drop" counted above)
      const unsigned rows = atomicExch(&f.state[MOECOMM_S_ROWS], 0u);
      if (!c.skip && !f.drop && rows > (unsigned)f.cap &&
          atomicCAS(&f.state[MOECOMM_S_BAD_RECV], 0u, MOECOMM_ERR_CAPACITY) == 0u) {
        f.state[MOECOMM_S_WHY] = rows;
        record_error(f.err, MOECOMM_ERR_CAPACITY, f.rank, MOECOMM_PHASE_DISPATCH, -1, (int)epoch, (int)rows);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      if (f.packed && !c.skip) {  // each expert's first row, from the kept counts the loop above wrote
        int first = 0;
        for (int le = 0; le < f.local_experts; ++le) {
          c.out_offsets[le] = first;
          first += c.out_num[le];
        }
        c.out_offsets[f.local_experts] = first;
      }
      if (!c.skip) tally(f, MOECOMM_C_CALLS, 1);  // an atomic, not waited for (a plain ++ waits for the load)
      f.state[MOECOMM_S_DONE_DR] = 0;
      f.state[MOECOMM_S_EPOCH_DR] = epoch;
    }
    TRACE_LAST(MOECOMM_TRACE_DISPATCH_RECV);
  }
}

extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_dispatch_recv(const Fixed f, const Call c) {
  dispatch_recv(f, c);
}
