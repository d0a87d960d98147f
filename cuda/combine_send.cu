// Combine, send half (expert side): send expert outputs back to the ranks of each token's DP group.
#include "alltoall.cuh"

using namespace moecomm;

// grid: world * parts blocks of 256 threads; block b serves the records received from rank b % world.
//   recv_buf        dispatch records (token index, weights) of the last dispatch
//   slot_of         [world, max_tokens, topk] int32 from dispatch_recv
//   y [local_experts, cap, hidden] out_dtype: expert outputs, laid out like dispatch's out_x
//   partials        1: sum a token's local experts weighted by the dispatched weights and send one row
//                   to comb_buf[me][token]; 0: send each expert's row to comb_buf[token][k]
//   comb_buf        symmetric [max(world, topk) * max_tokens, hidden] out_dtype on every rank
//   comb_sig        symmetric uint64 [world]: comb_sig[me] on each rank gets (epoch | 1) when done
extern "C" __global__ void __launch_bounds__(256)
    moecomm_combine_send(const long long* layout, unsigned* state, int* err, const uint8_t* recv_buf,
                         const int* slot_of, const uint8_t* y, int partials, uint8_t* comb_buf,
                         uint64_t* comb_sig, uint8_t* stage) {
  const Layout L(layout);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int src = blockIdx.x % L.world, part = blockIdx.x / L.world, parts = gridDim.x / L.world;
  const unsigned epoch = state[MOECOMM_S_EPOCH_CS] + 1;
  const unsigned count = state[L.s_recv + src];
  const int group0 = src / L.dp * L.dp;  // first rank of the source's DP group
  __shared__ int slots[8][MOECOMM_MAX_TOPK];
  __shared__ float wts[8][MOECOMM_MAX_TOPK];
  Stage st(stage, L, blockIdx.x * warps + warp);
  for (int j = part * warps + warp; j < (int)count; j += parts * warps) {
    const uint8_t* rec = recv_buf + ((size_t)src * L.max_tokens + j) * L.rec_bytes;
    const int* meta = meta_of(rec, L);
    const int t = meta[0];
    if (lane < L.topk) {
      slots[warp][lane] = slot_of[((size_t)src * L.max_tokens + j) * L.topk + lane];
      wts[warp][lane] = ((const float*)meta)[1 + L.topk + lane];
    }
    __syncwarp();
    if (partials) {
      uint8_t* row = st.next();
      for (int c = lane; c < L.out_row_bytes / 16; c += 32) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int k = 0; k < L.topk; ++k) {
          const int s = slots[warp][k];
          if (s < 0) continue;
          float v[8];
          load8(y + (size_t)s * L.out_row_bytes + c * 16, L.out_code, v);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[i] += wts[warp][k] * v[i];
        }
        store8(row + c * 16, L.out_code, acc);
      }
      __syncwarp();
      uint8_t* dst = comb_buf + ((size_t)L.rank * L.max_tokens + t) * L.out_row_bytes;
      for (int q = group0; q < group0 + L.dp; ++q) send_row(dst, row, L.out_row_bytes, q, lane, st);
    } else {
      for (int k = 0; k < L.topk; ++k) {
        const int s = slots[warp][k];
        if (s < 0) continue;
        const uint8_t* src_row = y + (size_t)s * L.out_row_bytes;
        uint8_t* dst = comb_buf + ((size_t)t * L.topk + k) * L.out_row_bytes;
        const uint8_t* row = nullptr;  // staged copy, made once if some peer needs a put
        for (int q = group0; q < group0 + L.dp; ++q) {
          uint8_t* p = peer_ptr(dst, q);
          if (p) {
            warp_copy16(p, src_row, L.out_row_bytes, lane);
            continue;
          }
          if (!row) {
            uint8_t* r = st.next();
            warp_copy16(r, src_row, L.out_row_bytes, lane);
            __syncwarp();
            row = r;
          }
          put_warp(dst, row, L.out_row_bytes, q);
          st.puts_pending = true;
        }
      }
    }
    __syncwarp();
  }
  quiet();
  if (last_block(&state[MOECOMM_S_DONE_CS])) {
    for (int q = threadIdx.x; q < L.world; q += blockDim.x) signal_set(&comb_sig[L.rank], epoch_signal(epoch, 1), q);
    __syncthreads();
    if (threadIdx.x == 0) {
      state[MOECOMM_S_DONE_CS] = 0;
      state[MOECOMM_S_EPOCH_CS] = epoch;
    }
  }
}
