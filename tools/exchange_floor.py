"""The floor of a small batch's dispatch + combine at EP2: two bare exchanges of the same rows, timed like the
benchmark.

    mpirun -np 2 python tools/exchange_floor.py [--transport ipc] [--tokens 1,128] [--iters 300]

Per token, each rank sends one row to the other and receives one, twice: a dispatch-sized row (fp8 + scales,
7392 B) in the first kernel, a combine-sized row (bf16, 14336 B) in the second. Each kernel is the least a
phase of moecomm must do: a block per row stores it into the peer's buffer, fences once, adds its arrival to
a counter on the peer, waits until the peer's blocks have all arrived, and copies its received row out. No
routing, no expert layout, no counts, no error words. The two kernels are one CUDA graph, replayed after a
device barrier and a delay like ``moecomm.bench``'s graph total (medians and p99 over ``--iters``, max over
ranks; the graph launch floor beside them), and the received rows are checked against the peer's.
"""
import argparse
import json
import sys

import numpy as np

import moecomm
from moecomm.bench import Bench, environment, stats

KERNEL = r"""
// grid: one block per row. Rows of `chunks` 16-byte chunks: x (this rank's) -> peer_inbox; inbox -> out.
// arrivals: the peer's blocks add 1 per call to this rank's *arrived; calls[b]: calls block b has made.
extern "C" __global__ void exchange(const int4* x, int4* peer_inbox, unsigned long long* peer_arrived,
                                    const int4* inbox, const unsigned long long* arrived, int4* out,
                                    unsigned long long* calls, int* failed, int chunks) {
  const long row = (long)blockIdx.x * chunks;
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) peer_inbox[row + c] = x[row + c];
  __syncthreads();
  __shared__ unsigned long long expected;
  if (threadIdx.x == 0) {
    asm volatile("fence.acq_rel.sys;" ::: "memory");
    atomicAdd_system(peer_arrived, 1ull);
    expected = ++calls[blockIdx.x] * gridDim.x;
    unsigned long long v, t0 = clock64();
    do {
      asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(arrived) : "memory");
    } while (v < expected && clock64() - t0 < 4000000000ull);  // ~2 s, then give up (a tool, not a hang)
    if (v < expected) *failed = 1;
  }
  __syncthreads();
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) out[row + c] = inbox[row + c];
}
"""
ROWS = {"dispatch": 7168 + 56 * 4, "combine": 7168 * 2}  # R1: fp8 row + float32 scales; a bf16 output row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transport", default="ipc", choices=["ipc", "nvshmem"])
    p.add_argument("--tokens", default="1,128", help="comma list of tokens per rank")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--delay-us", type=float, default=100.0)
    p.add_argument("--json", default=None, help="write the figures here (rank 0)")
    args = p.parse_args(argv)
    import cupy as cp
    comm = moecomm.init(transport=args.transport)
    t, rank = comm.transport, comm.rank
    if comm.world_size != 2:
        sys.exit("exchange_floor.py runs on 2 ranks")
    peer = 1 - rank
    bench = Bench(comm, args)
    kernel = cp.RawModule(code=KERNEL).get_function("exchange")
    results = {"launch_floor": bench.launch_floor()}
    with bench.stream:
        for m in [int(x) for x in args.tokens.split(",")]:
            phases = []
            for name, row in ROWS.items():
                chunks = row // 16
                inbox = t.symmetric((m, chunks, 4), np.int32)
                arrived = t.symmetric((1,), np.uint64)
                arrived.fill(0)
                x = cp.asarray(np.random.default_rng([rank, m, row]).integers(-2**31, 2**31 - 1, (m, chunks, 4),
                                                                              dtype=np.int32))
                out, calls, failed = cp.zeros_like(x), cp.zeros(m, np.uint64), cp.zeros(1, np.int32)
                args_ = (x, t.peer_array(inbox, peer), t.peer_array(arrived, peer), inbox, arrived, out, calls,
                         failed, np.int32(chunks))
                phases.append((name, args_, inbox, arrived, x, out, failed))
            t.settle("exchange_floor: buffers")
            graph = bench.capture(lambda: [kernel((m,), (256,), a) for _, a, *_ in phases])
            total = stats(bench.time_graphs([graph], 0))
            cp.cuda.get_current_stream().synchronize()
            for name, _, inbox, arrived, x, out, failed in phases:
                theirs = comm.allgather(cp.asnumpy(x))[peer]
                if int(failed.get()[0]) or not np.array_equal(cp.asnumpy(out), theirs):
                    sys.exit(f"rank {rank}: {name} rows of {m} tokens wrong or late")
            results[str(m)] = total
            t.settle("exchange_floor: done")
            for _, _, inbox, arrived, *_ in reversed(phases):
                t.free(arrived)
                t.free(inbox)
    if rank == 0:
        floor = results["launch_floor"]["median_us"]
        print(f"graph launch floor {floor:.1f} us; two bare exchanges (dispatch-, combine-sized rows) per replay:")
        for m, r in results.items():
            if m != "launch_floor":
                print(f"  {m:>5} tokens: median {r['median_us']:.1f} us, p99 {r['p99_us']:.1f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"command": "mpirun -np 2 python " + " ".join(sys.argv), "transport": args.transport,
                           "environment": environment(), "row_bytes": ROWS, "results": results}, f, indent=1)
    comm.finalize()


if __name__ == "__main__":
    main()
