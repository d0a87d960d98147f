// Combine, receive half (token side): wait for every expert rank, then sum each token's rows.
#include "alltoall.cuh"

using namespace moecomm;

// grid: any number of blocks of MOECOMM_BLOCK_THREADS; one block per token (strided) over the group's m.
//   comb_buf, comb_sig   as in combine_send (this rank's copies)
//   indices [rows, topk] int32, weights [rows, topk] float32 (read when partials == 0), bound_m [1] int32
//   out [rows, hidden] out_dtype: rows 0..m-1 written
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, 2)
    moecomm_combine_recv(const long long* layout, unsigned* state, int* err, const uint8_t* comb_buf,
                         const uint64_t* comb_sig, const int* indices, const float* weights,
                         const int* bound_m, int rows, int partials, uint8_t* out,
                         unsigned long long timeout_ns) {
  const Layout L(layout);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned epoch = state[MOECOMM_S_EPOCH_CR] + 1;
  const uint64_t deadline = now_ns() + timeout_ns;
  int m = *bound_m;
  if (m < 0 || m > rows || m > L.max_tokens) m = 0;  // dispatch reported it
  __shared__ const uint8_t* srcs[MOECOMM_MAX_TOPK];  // comb_buf rows to add for the block's token
  __shared__ float wts[MOECOMM_MAX_TOPK];
  __shared__ int n;
  __shared__ uint8_t* dst;
  for (int t = blockIdx.x;; t += gridDim.x) {
    if (warp == 0 && t < m) {  // the token's rows (before the first wait: indices do not depend on it)
      int e = -1;
      if (lane < L.topk) e = indices[(size_t)t * L.topk + lane];
      const bool valid = lane < L.topk && e >= 0 && e < L.num_experts;
      const int rank = valid ? e / L.local_experts : -1;
      bool once = valid;
      for (int j = 0; j < L.topk; ++j) {
        const int rj = __shfl_sync(FULL, rank, j);
        if (j < lane) once = once && rj != rank;
      }
      const bool use = partials ? once : valid;
      const unsigned mask = __ballot_sync(FULL, use);
      if (use) {
        const int pos = __popc(mask & ((1u << lane) - 1));
        const size_t row = partials ? (size_t)rank * L.max_tokens + t : (size_t)t * L.topk + lane;
        srcs[pos] = comb_buf + row * L.out_row_bytes;
        wts[pos] = partials ? 1.0f : weights[(size_t)t * L.topk + lane];
      }
      if (lane == 0) {
        n = __popc(mask);
        dst = out + (size_t)t * L.out_row_bytes;
      }
    }
    if (t == (int)blockIdx.x) {  // every block waits for every expert rank once, even with no token of its own
      for (int q = threadIdx.x; q < L.world; q += blockDim.x)
        wait_epoch(&comb_sig[q], epoch, deadline, err, q, MOECOMM_PHASE_COMBINE);
    }
    __syncthreads();
    if (t >= m) break;
    weighted_sum(srcs, wts, n, L.out_row_bytes, L.out_code, &dst, 1);
    __syncthreads();
  }
  if (last_block(&state[MOECOMM_S_DONE_CR])) {
    if (threadIdx.x == 0) {
      state[MOECOMM_S_DONE_CR] = 0;
      state[MOECOMM_S_EPOCH_CR] = epoch;
    }
  }
}
