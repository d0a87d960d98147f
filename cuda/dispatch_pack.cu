// Dispatch, packed layout: place each received row at its expert's offset, once the counts are known.
#include "alltoall.cuh"

using namespace moecomm;

// grid: world * parts blocks of MOECOMM_BLOCK_THREADS; block b serves the records received from rank
// b % world, one block per record (strided). Runs after dispatch_recv (f.packed only), which gave each
// kept (record, k) pair a slot within its expert in f.slot_of and wrote c.out_offsets [local_experts + 1].
// Writes the pair's row out_offsets[expert] + slot of c.out_x [cap, hidden] in_dtype and c.out_scale
// [cap, scales] float32 (or null), and that row back into f.slot_of (combine_send reads expert_y there).
// Nothing crosses the link here.
extern "C" __global__ void __launch_bounds__(MOECOMM_BLOCK_THREADS, MOECOMM_BLOCKS_PER_SM)
    moecomm_dispatch_pack(const Fixed f, const Call c) {
  after_previous_kernel();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int src = blockIdx.x % f.world, part = blockIdx.x / f.world, parts = gridDim.x / f.world;
  const int lo = f.rank * f.local_experts;
  const int records = c.skip ? 0 : (int)f.state[f.s_recv + src];
  __shared__ int n;
  __shared__ uint8_t* xdst[MOECOMM_MAX_TOPK];
  __shared__ uint8_t* sdst[MOECOMM_MAX_TOPK];
  for (int j = part; j < records; j += parts) {
    const uint8_t* rec = f.recv_buf + ((size_t)src * f.max_tokens + j) * f.rec_bytes;
    RowCopy copy;
    copy.load(f, rec, rec + f.x_bytes);  // in flight while warp 0 finds the rows
    if (warp == 0) {
      int row = -1;
      if (lane < f.topk) {
        int* slot = &f.slot_of[((size_t)src * f.max_tokens + j) * f.topk + lane];
        if (*slot >= 0) {
          row = c.out_offsets[meta_of(rec, f)[1 + lane] - lo] + *slot;
          *slot = row;
        }
      }
      list_rows(f, c, row, xdst, sdst, &n);
    }
    __syncthreads();
    copy.store(f, xdst, sdst, n, 0, rec, rec + f.x_bytes);
    __syncthreads();
  }
}
