"""The memory floor of R1-prefill's two phases on one GPU: HBM rates of their access patterns, measured.

    python tools/hbm_floor.py [--world 2,1] [--iters 50] [--json hbm-floor.json]

At prefill sizes each phase moves a few hundred MB through HBM beside its NVLink traffic. This tool times,
on one GPU with nothing else running, kernels that do nothing but each phase's memory pattern at full
occupancy (every thread a 16-byte chunk, grid-stride), with R1-prefill's shapes per rank. At EP2
(``--world 2``, the default):

* dispatch: token rows (fp8 + scales, 7392 B) read once and written into four expert rows each (a rank's own
  tokens, then the records it received), and the records landing from the peer (a memset of their bytes);
* combine: bf16 rows (14336 B) summed four at a time (the expert side: a peer's record) and five at a time
  (the token side: four own expert rows and the peer's partial sum), one row written per sum, and the
  partial sums landing from the peer (a memset).

At world size 1 (``--world 1``: every pair is the rank's own) the dispatch writes each token into its eight
expert rows, and the combine's token side sums a token's eight expert rows (the local path forms no partial
sums); nothing lands. The backward operations' patterns there too (bf16 gradients): dispatch_backward sums a
token's eight slot gradients (the combine's pattern), combine_backward reads a token's grad_out row and its
eight expert_y rows and writes its eight slot gradients (weight * row) beside the dot products. ``--world 2,1``
measures both, one after the other, into one JSON.

It prints each pattern's rate (bytes read + written per second) and each phase's time at those rates (the
pattern floor), and its time at the rate of a 1 GiB device-to-device copy (the copy floor): moecomm's kernels
are measured against both. The pattern kernels are plain grid-stride loops, so a kernel that keeps more
loads in flight can come in under their time by a few percent (the local path's R1-prefill does); the copy
rate bounds any kernel moving the same bytes more tightly. The NVLink floor, 369 GB/s of SM stores measured
on 2xH200, is the other (benchmarks/NOTES.md). CUDA events, warm-up, median over ``--iters``; no MPI, no
NVSHMEM.
"""
import argparse
import json
import sys

import numpy as np

KERNELS = r"""
// dst rows dest[r * fan + k] = src row r, k < fan (rows of `chunks` 16-byte chunks; a row -1: none, as in
// every kernel here)
extern "C" __global__ void fanout(const int4* src, int4* dst, const int* dest, long rows, int chunks, int fan) {
  for (long g = blockIdx.x * (long)blockDim.x + threadIdx.x; g < rows * chunks; g += (long)gridDim.x * blockDim.x) {
    const long r = g / chunks, c = g % chunks;
    const int4 v = src[g];
    for (int k = 0; k < fan; ++k)
      if (dest[r * fan + k] >= 0) dst[(long)dest[r * fan + k] * chunks + c] = v;
  }
}
// dst row r = sum over j < n of src rows rows_of[r * n + j] (bf16, accumulated in float)
extern "C" __global__ void wsum(const int4* src, int4* dst, const int* rows_of, long rows, int chunks, int n) {
  for (long g = blockIdx.x * (long)blockDim.x + threadIdx.x; g < rows * chunks; g += (long)gridDim.x * blockDim.x) {
    const long r = g / chunks, c = g % chunks;
    float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int j = 0; j < n; ++j) {
      if (rows_of[r * n + j] < 0) continue;
      const int4 v = src[(long)rows_of[r * n + j] * chunks + c];
      const unsigned u[4] = {(unsigned)v.x, (unsigned)v.y, (unsigned)v.z, (unsigned)v.w};
      for (int i = 0; i < 4; ++i) {
        a[2 * i] += __uint_as_float(u[i] << 16);
        a[2 * i + 1] += __uint_as_float(u[i] & 0xffff0000u);
      }
    }
    unsigned o[4];
    for (int i = 0; i < 4; ++i)
      o[i] = (__float_as_uint(a[2 * i]) >> 16) | (__float_as_uint(a[2 * i + 1]) & 0xffff0000u);
    dst[g] = make_int4((int)o[0], (int)o[1], (int)o[2], (int)o[3]);
  }
}
// combine_backward's pattern: dst rows rows_of[r * n + j] = 0.5 * src row r (bf16) and the dot product of src
// row r with y rows rows_of[r * n + j] (accumulated in float; stored only if it is a value never reached)
extern "C" __global__ void scale_dot(const int4* src, const int4* y, int4* dst, const int* rows_of, long rows,
                                     int chunks, int n, float* sink) {
  for (long g = blockIdx.x * (long)blockDim.x + threadIdx.x; g < rows * chunks; g += (long)gridDim.x * blockDim.x) {
    const long r = g / chunks, c = g % chunks;
    const int4 v = src[g];
    const unsigned u[4] = {(unsigned)v.x, (unsigned)v.y, (unsigned)v.z, (unsigned)v.w};
    unsigned o[4];
    float x[8];
    for (int i = 0; i < 4; ++i) {
      x[2 * i] = __uint_as_float(u[i] << 16);
      x[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
      o[i] = u[i] - (1u << 7) - (1u << 23);  // each value halved (its exponent less one)
    }
    float dot = 0.0f;
    for (int j = 0; j < n; ++j) {
      if (rows_of[r * n + j] < 0) continue;
      const long d = (long)rows_of[r * n + j] * chunks + c;
      const int4 t = y[d];
      const unsigned w[4] = {(unsigned)t.x, (unsigned)t.y, (unsigned)t.z, (unsigned)t.w};
      for (int i = 0; i < 4; ++i)
        dot += x[2 * i] * __uint_as_float(w[i] << 16) + x[2 * i + 1] * __uint_as_float(w[i] & 0xffff0000u);
      dst[d] = make_int4((int)o[0], (int)o[1], (int)o[2], (int)o[3]);
    }
    if (dot == 1234.5f) *sink = dot;
  }
}
"""

# R1-prefill, uniform routing: tokens, top-k, and at EP2 the records to the peer and own experts per token
TOKENS, TOPK, PEER_RECORDS, LOCAL = 4096, 8, 4081, 4
X_ROW, Y_ROW = 7168 + 56 * 4, 7168 * 2       # a token row (fp8 + float32 scales); an expert output row (bf16)


def floor(world, iters):
    """R1-prefill's patterns per rank at world size ``world`` (2: EP2, 1: alone): {world_size, patterns (each
    pattern's median / p99 / bytes / TB/s), floors_us (each phase at the patterns' rates), copy_floors_us (each
    phase's bytes at the 1 GiB copy's rate), record_bytes, grid}."""
    import cupy as cp
    from moecomm.bench import stats
    from moecomm.transport.gpu_alltoall import record_bytes
    from moecomm._config import AllToAllConfig
    cfg = AllToAllConfig.create(world, 0, TOKENS, 256, TOPK, 7168, 56, "float8_e4m3fn", "bfloat16", None, 1)
    peer_records, local = (PEER_RECORDS, LOCAL) if world == 2 else (0, TOPK)
    rec = record_bytes(cfg)
    mod = cp.RawModule(code=KERNELS)
    fanout, wsum, scale_dot = (mod.get_function(k) for k in ("fanout", "wsum", "scale_dot"))
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    grid, threads = (8 * sms,), (256,)
    rng = np.random.default_rng(0)

    def timed(fn):
        ev = [cp.cuda.Event() for _ in range(2)]
        for _ in range(5):
            fn()
        t = []
        for _ in range(iters):
            ev[0].record()
            fn()
            ev[1].record()
            ev[1].synchronize()
            t.append(cp.cuda.get_elapsed_time(ev[0], ev[1]) * 1e3)
        return stats(t)

    def rows(n_src, n_dst, per):  # per[r] distinct random rows of n_dst for each of n_src rows
        return cp.asarray(rng.permutation(n_dst)[:n_src * per].astype(np.int32))

    out = {}
    # dispatch: own tokens and received records fanned out to `local` expert rows each; records landing
    src_rows = TOKENS + peer_records
    x = cp.zeros((src_rows, X_ROW // 16, 4), np.int32)
    expert_rows = cp.zeros((src_rows * local, X_ROW // 16, 4), np.int32)
    dest = rows(src_rows, src_rows * local, local)
    fan_bytes = src_rows * X_ROW * (1 + local)
    out["fanout"] = dict(timed(lambda x=x, expert_rows=expert_rows: fanout(
                             grid, threads, (x, expert_rows, dest, np.int64(src_rows), np.int32(X_ROW // 16),
                                             np.int32(local)))),
                         bytes=fan_bytes)
    dispatch_keys, combine_keys = ["fanout"], []
    if peer_records:
        landing = cp.zeros(peer_records * rec, np.uint8)
        out["landing_dispatch"] = dict(timed(lambda: landing.fill(0)), bytes=landing.nbytes)  # a memset
        dispatch_keys.append("landing_dispatch")
        del landing
    del x, expert_rows
    # combine: the expert side sums `local` rows per peer record, the token side its own expert rows and the
    # peer's partial sum (world size 1: its eight own rows)
    y = cp.zeros((src_rows * local, Y_ROW // 16, 4), np.int32)
    tokens_out = cp.zeros((TOKENS, Y_ROW // 16, 4), np.int32)
    if peer_records:
        partial = cp.zeros((peer_records, Y_ROW // 16, 4), np.int32)
        of_expert = rows(peer_records, src_rows * local, local)
        out[f"sum{local}"] = dict(timed(lambda: wsum(grid, threads, (y, partial, of_expert, np.int64(peer_records),
                                                                       np.int32(Y_ROW // 16), np.int32(local)))),
                                  bytes=peer_records * Y_ROW * (local + 1))
        combine_keys.append(f"sum{local}")
    n_token = local + (1 if peer_records else 0)  # rows each token sums
    of_token = rows(TOKENS, src_rows * local, n_token)
    out[f"sum{n_token}"] = dict(timed(lambda: wsum(grid, threads, (y, tokens_out, of_token, np.int64(TOKENS),
                                                                     np.int32(Y_ROW // 16), np.int32(n_token)))),
                                bytes=TOKENS * Y_ROW * (n_token + 1))
    combine_keys.append(f"sum{n_token}")
    if peer_records:
        landing = cp.zeros(peer_records * Y_ROW, np.uint8)
        out["landing_combine"] = dict(timed(lambda: landing.fill(0)), bytes=landing.nbytes)
        combine_keys.append("landing_combine")
    phases = {"dispatch": dispatch_keys, "combine": combine_keys}
    if not peer_records:  # the backward operations alone (world size 1): their slot rows as the combine's
        grad_y, sink = cp.zeros_like(y), cp.zeros(1, np.float32)
        out[f"scale_dot{local}"] = dict(
            timed(lambda: scale_dot(grid, threads, (tokens_out, y, grad_y, of_token, np.int64(TOKENS),
                                                    np.int32(Y_ROW // 16), np.int32(local), sink))),
            bytes=TOKENS * Y_ROW * (1 + 2 * local))
        phases.update(dispatch_backward=[f"sum{n_token}"], combine_backward=[f"scale_dot{local}"])
        del grad_y
    big = cp.zeros(1 << 30, np.uint8)
    copy = cp.empty_like(big)
    out["copy_1GiB"] = dict(timed(lambda: copy.__setitem__(Ellipsis, big)), bytes=2 * big.nbytes)
    for v in out.values():
        v["TBps"] = v["bytes"] / v["median_us"] / 1e6
    floors = {phase: sum(out[k]["median_us"] for k in keys) for phase, keys in phases.items()}
    copy_floors = {phase: sum(out[k]["bytes"] for k in keys) / out["copy_1GiB"]["TBps"] / 1e6
                   for phase, keys in phases.items()}
    print(f"{'pattern':<18} {'MB':>8} {'median us':>10} {'TB/s':>6}")
    for k, v in out.items():
        print(f"{k:<18} {v['bytes'] / 1e6:>8.1f} {v['median_us']:>10.1f} {v['TBps']:>6.2f}")
    where = "EP2" if world == 2 else "world size 1"
    print(f"R1-prefill per rank at {where}: " + "; ".join(
        f"{phase} pattern floor {floors[phase]:.1f} us, copy floor {copy_floors[phase]:.1f} us" for phase in phases))
    return {"world_size": world, "patterns": out, "floors_us": floors, "copy_floors_us": copy_floors,
            "record_bytes": rec, "grid": [grid[0], threads[0]]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", default="2", help="R1-prefill per rank at EP2 (2), alone (1), or both (2,1)")
    p.add_argument("--iters", type=int, default=50, help="timed replays per pattern (default 50)")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    worlds = [int(w) for w in args.world.split(",")]
    if not set(worlds) <= {1, 2}:
        p.error(f"--world {args.world}: world sizes 1 and 2 only")
    from moecomm.bench import environment
    runs = [floor(w, args.iters) for w in worlds]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python " + " ".join(sys.argv), "environment": environment(), "runs": runs},
                      f, indent=1)


if __name__ == "__main__":
    main()
