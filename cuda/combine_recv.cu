// Combine, receive half (token side): wait for every expert rank, then sum each token's rows.
#include "alltoall.cuh"

using namespace moecomm;

// grid: any number of blocks of 256 threads; one warp per token (strided) over the group's m tokens.
//   comb_buf, comb_sig   as in combine_send (this rank's copies)
//   indices [rows, topk] int32, weights [rows, topk] float32 (read when partials == 0), bound_m [1] int32
//   out [rows, hidden] out_dtype: rows 0..m-1 written
extern "C" __global__ void __launch_bounds__(256)
    moecomm_combine_recv(const long long* layout, unsigned* state, int* err, const uint8_t* comb_buf,
                         const uint64_t* comb_sig, const int* indices, const float* weights,
                         const int* bound_m, int rows, int partials, uint8_t* out,
                         unsigned long long timeout_ns) {
  const Layout L(layout);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gwarp = blockIdx.x * (blockDim.x >> 5) + warp, nwarps = gridDim.x * (blockDim.x >> 5);
  const unsigned epoch = state[MOECOMM_S_EPOCH_CR] + 1;
  const uint64_t deadline = now_ns() + timeout_ns;
  for (int q = threadIdx.x; q < L.world; q += blockDim.x)
    wait_epoch(&comb_sig[q], epoch, deadline, err, q, MOECOMM_PHASE_COMBINE);
  __syncthreads();
  int m = *bound_m;
  if (m < 0 || m > rows || m > L.max_tokens) m = 0;  // dispatch reported it
  __shared__ int rows_of[8][MOECOMM_MAX_TOPK];   // comb_buf rows to add for the warp's token
  __shared__ float wts[8][MOECOMM_MAX_TOPK];
  for (int t = gwarp; t < m; t += nwarps) {
    int e = -1;
    if (lane < L.topk) e = indices[(size_t)t * L.topk + lane];
    const bool valid = e >= 0 && e < L.num_experts;
    const int rank = valid ? e / L.local_experts : -1;
    bool first = lane < L.topk && valid;
    for (int j = 0; j < L.topk; ++j) {
      const int rj = __shfl_sync(FULL, rank, j);
      if (j < lane) first = first && rj != rank;
    }
    if (lane < L.topk) {
      if (partials) {
        rows_of[warp][lane] = first ? rank * L.max_tokens + t : -1;
        wts[warp][lane] = 1.0f;
      } else {
        rows_of[warp][lane] = valid ? t * L.topk + lane : -1;
        wts[warp][lane] = weights[(size_t)t * L.topk + lane];
      }
    }
    __syncwarp();
    for (int c = lane; c < L.out_row_bytes / 16; c += 32) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int k = 0; k < L.topk; ++k) {
        const int r = rows_of[warp][k];
        if (r < 0) continue;
        float v[8];
        load8(comb_buf + (size_t)r * L.out_row_bytes + c * 16, L.out_code, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += wts[warp][k] * v[i];
      }
      store8(out + (size_t)t * L.out_row_bytes + c * 16, L.out_code, acc);
    }
    __syncwarp();
  }
  if (last_block(&state[MOECOMM_S_DONE_CR])) {
    if (threadIdx.x == 0) {
      state[MOECOMM_S_DONE_CR] = 0;
      state[MOECOMM_S_EPOCH_CR] = epoch;
    }
  }
}
