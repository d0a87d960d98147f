"""The floor of a small batch's dispatch + combine at EP2: two bare exchanges of the same rows, timed like the
benchmark.

    mpirun -np 2 python tools/exchange_floor.py [--transport ipc] [--tokens 1,128] [--iters 300]

Per token, each rank sends one row to the other and receives one, twice: a dispatch-sized row (fp8 + scales,
7392 B) in the first kernel, a combine-sized row (bf16, 14336 B) in the second. Each kernel is the least a
phase must do, in one of two protocols:

* ``fence`` (moecomm's): a block per row stores it into the peer's buffer, fences once, adds its arrival to a
  counter on the peer, waits until the peer's blocks have all arrived, and copies its received row out;
* ``ll`` (NCCL's LL): every 4 bytes of the row travel with the call number in one 8-byte store (twice the
  bytes, no fence, no counter); the receiver polls its words until each carries the call, and writes the
  data out.

No routing, no expert layout, no counts, no error words. The two kernels are one CUDA graph, replayed after a
device barrier and a delay like ``moecomm.bench``'s graph total (medians and p99 over ``--iters``, max over
ranks; the graph launch floor beside them); the barrier before every replay is also what lets a call reuse
the last call's buffers. The received rows are checked against the peer's.
"""
import argparse
import json
import sys

import numpy as np

import moecomm
from moecomm.bench import Bench, environment, stats

KERNELS = r"""
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

// LL: row word i of x travels as (call << 32 | word) in one 8-byte store into peer_inbox; each thread polls its
// words of inbox (up to LL_WORDS, all loads in flight together) until every one carries the call.
#define LL_WORDS 16
extern "C" __global__ void exchange_ll(const unsigned* x, unsigned long long* peer_inbox,
                                       const unsigned long long* inbox, unsigned* out, unsigned* calls,
                                       int* failed, int words) {
  __shared__ unsigned call;
  if (threadIdx.x == 0) call = ++calls[blockIdx.x];
  __syncthreads();
  const unsigned e = call;
  const long row = (long)blockIdx.x * words;
  for (int i = threadIdx.x; i < words; i += blockDim.x)
    asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(peer_inbox + row + i),
                 "l"((unsigned long long)e << 32 | x[row + i]) : "memory");
  unsigned long long v[LL_WORDS];
#pragma unroll
  for (int u = 0; u < LL_WORDS; ++u) v[u] = 0;
  const long long t0 = clock64();
  for (;;) {
    bool done = true;
#pragma unroll
    for (int u = 0; u < LL_WORDS; ++u) {
      const int i = threadIdx.x + u * blockDim.x;
      if (i < words && (unsigned)(v[u] >> 32) != e)
        asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v[u]) : "l"(inbox + row + i) : "memory");
    }
#pragma unroll
    for (int u = 0; u < LL_WORDS; ++u)
      done = done && (threadIdx.x + u * blockDim.x >= words || (unsigned)(v[u] >> 32) == e);
    if (done) break;
    if (clock64() - t0 > 4000000000ll) {  // ~2 s
      *failed = 1;
      break;
    }
  }
#pragma unroll
  for (int u = 0; u < LL_WORDS; ++u)
    if (threadIdx.x + u * blockDim.x < words) out[row + threadIdx.x + u * blockDim.x] = (unsigned)v[u];
}
"""
THREADS, LL_WORDS = 256, 16
ROWS = {"dispatch": 7168 + 56 * 4, "combine": 7168 * 2}  # R1: fp8 row + float32 scales; a bf16 output row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transport", default="ipc", choices=["ipc", "nvshmem"], help="GPU transport (default ipc)")
    p.add_argument("--tokens", default="1,128", help="comma list of tokens per rank")
    p.add_argument("--iters", type=int, default=300, help="timed exchanges per case (default 300)")
    p.add_argument("--warmup", type=int, default=50, help="untimed exchanges first (default 50)")
    p.add_argument("--delay-us", type=float, default=100.0,
                   help="device delay before each timed exchange, µs (default 100)")
    p.add_argument("--json", default=None, help="write the figures here (rank 0)")
    args = p.parse_args(argv)
    import cupy as cp
    comm = moecomm.init(transport=args.transport)
    t, rank = comm.transport, comm.rank
    if comm.world_size != 2:
        sys.exit("exchange_floor.py runs on 2 ranks")
    peer = 1 - rank
    bench = Bench(comm, args)
    module = cp.RawModule(code=KERNELS)
    kernels = {"fence": module.get_function("exchange"), "ll": module.get_function("exchange_ll")}
    results = {"launch_floor": bench.launch_floor(), "fence": {}, "ll": {}}
    rng = np.random.default_rng(rank)
    with bench.stream:
        for m in [int(x) for x in args.tokens.split(",")]:
            for protocol, kernel in kernels.items():
                phases, symmetric = [], []
                for name, row in ROWS.items():
                    words = row // 4
                    assert words <= THREADS * LL_WORDS
                    x = cp.asarray(rng.integers(0, 2**32, (m, words), dtype=np.uint32))
                    out, failed = cp.zeros_like(x), cp.zeros(1, np.int32)
                    if protocol == "fence":
                        inbox, arrived = t.symmetric((m, words), np.uint32), t.symmetric((1,), np.uint64)
                        arrived.fill(0)
                        symmetric += [inbox, arrived]
                        args_ = (x, t.peer_array(inbox, peer), t.peer_array(arrived, peer), inbox, arrived, out,
                                 cp.zeros(m, np.uint64), failed, np.int32(row // 16))
                    else:
                        inbox = t.symmetric((m, words), np.uint64)
                        inbox.fill(0)
                        symmetric.append(inbox)
                        args_ = (x, t.peer_array(inbox, peer), inbox, out, cp.zeros(m, np.uint32), failed,
                                 np.int32(words))
                    phases.append((name, args_, x, out, failed))
                t.settle("exchange_floor: buffers")
                graph = bench.capture(lambda: [kernel((m,), (THREADS,), a) for _, a, *_ in phases])
                results[protocol][str(m)] = stats(bench.time_graphs([graph], 0))
                cp.cuda.get_current_stream().synchronize()
                for name, _, x, out, failed in phases:
                    theirs = comm.allgather(cp.asnumpy(x))[peer]
                    if int(failed.get()[0]) or not np.array_equal(cp.asnumpy(out), theirs):
                        sys.exit(f"rank {rank}: {protocol} {name} rows of {m} tokens wrong or late")
                t.settle("exchange_floor: done")
                for a in reversed(symmetric):
                    t.free(a)
    if rank == 0:
        floor = results["launch_floor"]["median_us"]
        print(f"graph launch floor {floor:.1f} us; two bare exchanges (dispatch-, combine-sized rows) per replay:")
        for protocol in kernels:
            for m, r in results[protocol].items():
                print(f"  {protocol:<5} {m:>5} tokens: median {r['median_us']:.1f} us, p99 {r['p99_us']:.1f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"command": "mpirun -np 2 python " + " ".join(sys.argv), "transport": args.transport,
                           "environment": environment(), "row_bytes": ROWS, "results": results}, f, indent=1)
    comm.finalize()


if __name__ == "__main__":
    main()
