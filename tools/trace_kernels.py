"""Where the time goes inside the kernels: SM-clock stamps at the end of each stage of each half.

    MOECOMM_TRACE=1 mpirun -np 2 -x MOECOMM_TRACE python tools/trace_kernels.py [--transport ipc]
        [--tokens 128] [--iters 200] [--split] [--json out.json]

Needs a build with the trace option (``MOECOMM_TRACE=1`` in the environment when the kernels are built: it
is part of the build-cache key, so traced and plain builds live side by side). R1 shapes (256 experts,
top-8, hidden 7168, fp8 with 56 scales, bf16 out), uniform routing. One CUDA graph of dispatch + combine
(both halves in one launch each; ``--split``: the four half kernels) is replayed after a device barrier;
after each replay the stamps are read back (a device delay first, so that the graph is queued before it
starts, as in the benchmark). Thread 0 of the block that takes a half's first token or record stamps the
end of each stage, so each figure is the time since the previous stamp on that block's path (block 0 in
the send halves: tokens 0.. in dispatch_send, records of rank 0 in combine_send; the grid's last block in
the receive halves: records of the first other rank in dispatch_recv, tokens 0.. in combine_recv; in one
launch per phase its receive half starts when its send half ends); "last block: signals" is the time
the grid's last block spends on its epilogue (signals to the peers, counters). The SM clock's rate,
measured against the global timer over block 0's kernels, converts cycles to microseconds. Each kernel's
span follows on the global timer: its first and last block entry and exit, from a one-thread stamp kernel
before the graph's kernels to another after them. Rank 0 prints medians (p90) per rank; the stamps cost a
store (an atomic at entry and exit) each, so the traced build runs a little slower.
"""
import argparse
import json

import cupy
import numpy as np
from cuda.bindings import driver

import moecomm
from moecomm import _constants as C
from moecomm.bench import delay_kernel, routing

# What each stamp of a half ends (cuda/*.cu, TRACE(half, point)); the half's last slot is the epilogue. Where
# records stream, dispatch_recv's first two stamps come together (the first record's arrival and its slots), and
# in both receive halves "first ... copied / summed" also covers warp 0 preparing the next record or token.
STAGES = {
    "dispatch_send": ("start", "m and epoch read", "first token routed (ids, slots)", "first token sent",
                      "all tokens sent", "fence + block count"),
    "dispatch_recv": ("start", "source's signal seen", "first record routed (slots)", "first record copied",
                      "all records copied", "block count"),
    "combine_send": ("start", "first record read (slots, weights)", "first record summed and sent",
                     "all records sent", "fence + block count"),
    "combine_recv": ("start", "every signal seen", "first token listed", "first token summed", "all tokens summed"),
}


def figures(rows, mhz):
    """{half: {stage: [median, p90] microseconds}} from the stamps of many replays, ``rows`` [replays,
    len(HALVES), TRACE_POINTS] int64 SM clocks at ``mhz``: each stage the stamping block reached timed
    from the previous one it reached (a stage it did not reach, its stamp 0 in every replay, is left out), the
    block's span, and the last block's epilogue where the half times one."""
    out = {}
    for h, half in enumerate(C.HALVES):
        reached = [i for i, _ in enumerate(STAGES[half]) if rows[:, h, i].all()]
        if not reached:  # a half no kernel of the graph stamps (the local path: cuda/local.cu)
            continue
        names = [STAGES[half][i] for i in reached]
        stamps = rows[:, h, reached]
        d = np.diff(stamps, axis=1) / mhz
        stage = {names[i + 1]: [float(np.median(d[:, i])), float(np.percentile(d[:, i], 90))]
                 for i in range(len(names) - 1)}
        span = float(np.median(stamps[:, -1] - stamps[:, 0]) / mhz)
        stage["stamping block, start to end"] = [span, span]
        last = rows[:, h, -1]
        if last.any():
            stage["last block: signals, counters"] = [float(np.median(last) / mhz),
                                                      float(np.percentile(last, 90) / mhz)]
        out[half] = stage
    return out


# A one-thread kernel that stores the global timer (the graph's first and last node).
STAMP = cupy.RawKernel(r"""extern "C" __global__ void stamp(unsigned long long* out) {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  *out = t;
}""", "stamp")


def kernels(spans):
    """``spans`` [replays, 2 + halves * TRACE_SPAN] as [replays, halves, TRACE_SPAN], and the halves whose
    kernel ran (named by the half it starts with: block 0 stamped its exit in every replay)."""
    s = spans[:, 2:].reshape(len(spans), len(C.HALVES), C.TRACE_SPAN)
    return s, [h for h in range(len(C.HALVES)) if s[:, h, 5].all()]


def spans_clock(spans):
    """The SM clock's rate (Hz) over the replays: block 0's clock cycles against the global timer between
    its entry and exit stamps of each kernel."""
    s, ran = kernels(spans)
    cycles, ns = (s[:, ran, 5] - s[:, ran, 4]).sum(1), (s[:, ran, 7] - s[:, ran, 6]).sum(1)
    return float(np.median(cycles / ns) * 1e9)


def timeline(spans):
    """{event: median microseconds since the stamp before the graph}: each kernel's first and last block
    entry and exit (named by the half it starts with), and the stamp after the graph."""
    s, ran = kernels(spans)
    out = {}
    for h in ran:
        for i, what in enumerate(("first entry", "last entry", "first exit", "last exit")):
            out[f"{C.HALVES[h]} kernel {what}"] = float(np.median(s[:, h, i] - spans[:, 0]) / 1e3)
    out["stamp after"] = float(np.median(spans[:, 1] - spans[:, 0]) / 1e3)
    return out


def table(everyone):
    """The figures of every rank (a list of figures()), a stage per line, a column per rank."""
    lines = []
    for half in (h for h in C.HALVES if any(h in f for f in everyone)):
        lines.append(f"{half}" + "".join(f"{'rank ' + str(r):>16s}" for r in range(len(everyone))))
        for stage in dict.fromkeys(s for f in everyone for s in f.get(half, {})):
            cells = "  ".join(f"{f[half][stage][0]:6.2f} ({f[half][stage][1]:5.2f})" if stage in f.get(half, {})
                              else f"{'-':>14s}" for f in everyone)
            lines.append(f"  {stage:38s} {cells}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transport", default="ipc", choices=["nvshmem", "ipc"], help="GPU transport (default ipc)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank (default 128)")
    p.add_argument("--iters", type=int, default=200, help="traced replays (default 200)")
    p.add_argument("--split", action="store_true", help="the four half kernels instead of one launch per phase")
    p.add_argument("--json", help="write every rank's figures here (rank 0)")
    args = p.parse_args()
    comm = moecomm.init(transport=args.transport)
    tr = comm.transport
    W, rank, T, E, K, H, S = comm.world_size, comm.rank, args.tokens, 256, 8, 7168, 56
    L = E // W
    a2a = moecomm.AllToAll(comm, T, E, K, H, S, "float8_e4m3fn", "bfloat16")
    module = tr.module_of(a2a.stats()["plan"]["variant"])  # the module its kernels come from
    err, ptr, size = driver.cuModuleGetGlobal(module.handle, b"moecomm_trace")
    if err != driver.CUresult.CUDA_SUCCESS:
        raise SystemExit("the kernels were built without MOECOMM_TRACE=1 (set it for the build and the run)")
    slots = len(C.HALVES) * C.TRACE_POINTS
    trace = cupy.ndarray((slots,), np.int64, cupy.cuda.MemoryPointer(
        cupy.cuda.UnownedMemory(int(ptr), int(size), tr), 0))
    _, sptr, ssize = driver.cuModuleGetGlobal(module.handle, b"moecomm_span")
    span = cupy.ndarray((len(C.HALVES), C.TRACE_SPAN), np.uint64, cupy.cuda.MemoryPointer(
        cupy.cuda.UnownedMemory(int(sptr), int(ssize), tr), 0))
    span_init = cupy.asarray(np.array([[2**64 - 1, 0] * 2 + [0] * 4] * len(C.HALVES), np.uint64))
    ends = cupy.zeros(2, np.uint64)  # the global timer just before and just after the graph's kernels
    delay_args, delay = delay_kernel(tr)

    rng = np.random.default_rng([7, T])
    idx = [routing(rng, T, K, E, "uniform") for _ in range(W)][rank]
    x = cupy.asarray(rng.integers(0, 255, (T, H), np.uint8) & 0x77)
    xs, w = cupy.asarray(rng.random((T, S), np.float32)), cupy.asarray(rng.random((T, K), np.float32))
    idx, m = cupy.asarray(idx), cupy.asarray(np.array([T], np.int32))
    n, ex, es = cupy.zeros(L, np.int32), cupy.zeros((L, T * W, H), np.uint8), cupy.zeros((L, T * W, S), np.float32)
    y, out = cupy.full((L, T * W, H), 0x3C00, np.uint16), cupy.zeros((T, H), np.uint16)
    halves = ((True, False), (False, True)) if args.split else ((True, True),)
    stream = cupy.cuda.Stream(non_blocking=True)

    def step():
        for send, recv in halves:
            a2a.dispatch(n, ex, es, x, xs, idx, m, do_send=send, do_recv=recv, weights=w, stream=stream)
        for send, recv in halves:
            a2a.combine(out, idx, None, y, m, do_send=send, do_recv=recv, stream=stream)

    with stream:
        step()
        STAMP((1,), (1,), (ends[0:1],))  # compiled and loaded before the capture
        a2a.synchronize(stream)
        stream.begin_capture()
        STAMP((1,), (1,), (ends[0:1],))
        step()
        STAMP((1,), (1,), (ends[1:2],))
        graph = stream.end_capture()
        rows, spans = [], []
        for it in range(args.iters + 10):
            # the stamps are reset first: the reset copies from pageable memory and may hold the host, and nothing
            # that can must come between the barrier and the graph (the ranks' delays then start together, and
            # the graph is queued before it starts, as in the benchmark)
            trace.fill(0)
            span[...] = span_init
            tr.barrier(stream.ptr)
            delay_args.ns = 100_000
            delay(stream.ptr)
            graph.launch(stream)
            stream.synchronize()
            if it >= 10:
                rows.append(trace.get())
                spans.append(np.concatenate([ends.get(), span.get().ravel()]))
        a2a.synchronize(stream)
    rows = np.array(rows).reshape(len(rows), len(C.HALVES), C.TRACE_POINTS)
    spans = np.array(spans, np.int64)
    hz = spans_clock(spans)
    mhz = cupy.cuda.runtime.getDeviceProperties(tr.device)["clockRate"] / 1e3
    everyone = comm.allgather(figures(rows, hz / 1e6))
    timelines = comm.allgather(timeline(spans))
    if rank == 0:
        mode = "the four half kernels" if args.split else "one launch per phase"
        print(f"{args.transport}, {T} tokens per rank, {mode}, {args.iters} replays: microseconds since the previous "
              f"stamp, median (p90), SM clock measured {hz / 1e6:.0f} MHz (rated {mhz:.0f})")
        print(table(everyone))
        print("kernel spans (global timer, microseconds from the stamp before the graph; median)")
        for r, tl in enumerate(timelines):
            print(f"  rank {r}: " + ", ".join(f"{k} {v:.2f}" for k, v in tl.items()))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(dict(transport=args.transport, tokens=T, split=args.split, iters=args.iters,
                               sm_clock_mhz=hz / 1e6, rated_sm_clock_mhz=mhz, ranks=everyone,
                               kernel_spans=timelines), fh, indent=1)
    a2a.destroy()
    comm.finalize()


if __name__ == "__main__":
    main()
