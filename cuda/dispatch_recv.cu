// Dispatch, receive half: wait for every source rank, fan its records out to the local experts.
// This rank's own tokens were put in place by dispatch_send; their records are only counted here.
#include "alltoall.cuh"

using namespace moecomm;

// grid: world * parts blocks of MOECOMM_BLOCK_THREADS; block b serves source rank b % world, one block
// per record (strided); each record is read once and stored into every local expert it goes to.
//   recv_buf, sig    as in dispatch_send (this rank's copies)
//   out_num [local_experts] int32; out_x [local_experts, cap, hidden] in_dtype;
//   out_scale [local_experts, cap, scales] float32 or null
//   slot_of [world, max_tokens, topk] int32: where record (src, j)'s k-th expert slot is (le*cap+slot, -1)
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, 2)
    moecomm_dispatch_recv(const long long* layout, unsigned* state, int* err, const uint8_t* recv_buf,
                          const uint64_t* sig, int* out_num, uint8_t* out_x, float* out_scale, int* slot_of,
                          unsigned long long timeout_ns) {
  const Layout L(layout);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int src = blockIdx.x % L.world, part = blockIdx.x / L.world, parts = gridDim.x / L.world;
  const unsigned epoch = state[MOECOMM_S_EPOCH_DR] + 1;
  __shared__ unsigned count;
  __shared__ int n;
  __shared__ uint8_t* xdst[MOECOMM_MAX_TOPK];
  __shared__ uint8_t* sdst[MOECOMM_MAX_TOPK];
  if (threadIdx.x == 0) {
    const uint64_t v = wait_epoch(&sig[src], epoch, now_ns() + timeout_ns, err, src, MOECOMM_PHASE_DISPATCH);
    if (v & SIG_BAD) record_error(err, MOECOMM_ERR_BAD_EXPERT, src, MOECOMM_PHASE_DISPATCH, -1);
    count = (v & SIG_BAD) ? 0 : (unsigned)(v & SIG_COUNT);
    if (count > (unsigned)L.max_tokens) {
      record_error(err, MOECOMM_ERR_OVERFLOW, src, MOECOMM_PHASE_DISPATCH, count);
      count = 0;
    }
    if (part == 0) state[L.s_recv + src] = count;
  }
  __syncthreads();
  const int lo = L.rank * L.local_experts;
  const int records = src == L.rank ? 0 : (int)count;
  for (int j = part; j < records; j += parts) {
    const uint8_t* rec = recv_buf + ((size_t)src * L.max_tokens + j) * L.rec_bytes;
    if (warp == 0) {  // a slot in each local expert of the record (in parallel lanes)
      int where = -1;
      if (lane < L.topk) {
        const int le = meta_of(rec, L)[1 + lane] - lo;
        if (le >= 0 && le < L.local_experts) {
          const unsigned slot = atomicAdd(&state[L.s_expert + le], 1u);
          if (slot < (unsigned)L.cap) {
            where = le * L.cap + slot;
          } else {
            record_error(err, MOECOMM_ERR_OVERFLOW, src, MOECOMM_PHASE_DISPATCH, le);
          }
        }
        slot_of[((size_t)src * L.max_tokens + j) * L.topk + lane] = where;
      }
      const unsigned mask = __ballot_sync(FULL, where >= 0);
      if (where >= 0) {
        const int pos = __popc(mask & ((1u << lane) - 1));
        xdst[pos] = out_x + (size_t)where * L.x_bytes;
        sdst[pos] = (uint8_t*)(out_scale + (size_t)where * (L.scale_bytes / 4));
      }
      if (lane == 0) n = __popc(mask);
    }
    __syncthreads();
    fanout16(xdst, n, rec, L.x_bytes, 0);
    if (L.scale_bytes) fanout4(sdst, n, rec + L.x_bytes, L.scale_bytes, 0);
    __syncthreads();
  }
  if (last_block(&state[MOECOMM_S_DONE_DR])) {
    for (int le = threadIdx.x; le < L.local_experts; le += blockDim.x) {
      const unsigned cnt = atomicExch(&state[L.s_expert + le], 0u);
      out_num[le] = cnt < (unsigned)L.cap ? cnt : L.cap;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      state[MOECOMM_S_DONE_DR] = 0;
      state[MOECOMM_S_EPOCH_DR] = epoch;
    }
  }
}
