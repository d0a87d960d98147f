"""Where the time goes inside the kernels: SM-clock stamps at the end of each stage of each half.

    MOECOMM_TRACE=1 mpirun -np 2 -x MOECOMM_TRACE python tools/trace_kernels.py [--transport ipc]
        [--tokens 128] [--iters 200] [--split] [--json out.json]

Needs a build with the trace option (``MOECOMM_TRACE=1`` in the environment when the kernels are built: it
is part of the build-cache key, so traced and plain builds live side by side). R1 shapes (256 experts,
top-8, hidden 7168, fp8 with 56 scales, bf16 out), uniform routing. One CUDA graph of dispatch + combine
(both halves in one launch each; ``--split``: the four half kernels) is replayed after a device barrier;
after each replay the stamps are read back. Thread 0 of block 0 stamps the end of each stage, so each
figure is the time since the previous stamp on that block's path (block 0 serves tokens 0.., records of
rank 0 in combine_send, and of the first other rank in dispatch_recv); "last block: signals" is the time
the grid's last block spends on its epilogue (signals to the peers, counters). The SM clock's rate
converts cycles to microseconds. Rank 0 prints medians (p90) per rank; the stamps cost a store each, so
the traced build runs a little slower.
"""
import argparse
import json

import cupy
import numpy as np
from cuda.bindings import driver

import moecomm
from moecomm import _constants as C
from moecomm.bench import routing

# What each stamp of a half ends (cuda/*.cu, TRACE(half, point)); the half's last slot is the epilogue.
STAGES = {
    "dispatch_send": ("start", "m and epoch read", "first token routed (ids, slots)", "first token sent",
                      "all tokens sent", "fence + block count"),
    "dispatch_recv": ("start", "source's signal seen", "first record routed (slots)", "first record copied",
                      "all records copied", "block count"),
    "combine_send": ("start", "first record read (slots, weights)", "first record summed and sent",
                     "all records sent", "fence + block count"),
    "combine_recv": ("start", "every signal seen", "first token listed", "first token summed", "all tokens summed",
                     "block count"),
}


def figures(rows, mhz):
    """{half: {stage: [median, p90] microseconds}} from the stamps of many replays, ``rows`` [replays,
    len(TRACE_HALVES), TRACE_POINTS] int64 SM clocks at ``mhz``: each stage block 0 reached timed from the
    previous one it reached (a stage it did not reach, its stamp 0 in every replay, is left out: a receive
    half's block 0 may have no records), block 0's span, and the last
    block's epilogue where the half times one."""
    out = {}
    for h, half in enumerate(C.TRACE_HALVES):
        reached = [i for i, _ in enumerate(STAGES[half]) if rows[:, h, i].all()]
        names = [STAGES[half][i] for i in reached]
        stamps = rows[:, h, reached]
        d = np.diff(stamps, axis=1) / mhz
        stage = {names[i + 1]: [float(np.median(d[:, i])), float(np.percentile(d[:, i], 90))]
                 for i in range(len(names) - 1)}
        span = float(np.median(stamps[:, -1] - stamps[:, 0]) / mhz)
        stage["block 0, start to end"] = [span, span]
        last = rows[:, h, -1]
        if last.any():
            stage["last block: signals, counters"] = [float(np.median(last) / mhz), float(np.percentile(last, 90) / mhz)]
        out[half] = stage
    return out


def table(everyone):
    """The figures of every rank (a list of figures()), a stage per line, a column per rank."""
    lines = []
    for half in C.TRACE_HALVES:
        lines.append(f"{half}" + "".join(f"{'rank ' + str(r):>16s}" for r in range(len(everyone))))
        for stage in dict.fromkeys(s for f in everyone for s in f[half]):
            cells = "  ".join(f"{f[half][stage][0]:6.2f} ({f[half][stage][1]:5.2f})" if stage in f[half]
                              else f"{'-':>14s}" for f in everyone)
            lines.append(f"  {stage:38s} {cells}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transport", default="ipc", choices=["nvshmem", "ipc"])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--split", action="store_true", help="the four half kernels instead of one launch per phase")
    p.add_argument("--json", help="write every rank's figures here (rank 0)")
    args = p.parse_args()
    comm = moecomm.init(transport=args.transport)
    tr = comm.transport
    err, ptr, size = driver.cuModuleGetGlobal(tr.module.handle, b"moecomm_trace")
    if err != driver.CUresult.CUDA_SUCCESS:
        raise SystemExit("the kernels were built without MOECOMM_TRACE=1 (set it for the build and the run)")
    slots = len(C.TRACE_HALVES) * C.TRACE_POINTS
    trace = cupy.ndarray((slots,), np.int64, cupy.cuda.MemoryPointer(
        cupy.cuda.UnownedMemory(int(ptr), int(size), tr), 0))

    W, rank, T, E, K, H, S = comm.world_size, comm.rank, args.tokens, 256, 8, 7168, 56
    L = E // W
    a2a = moecomm.AllToAll(comm, T, E, K, H, S, "float8_e4m3fn", "bfloat16")
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
        a2a.synchronize(stream)
        stream.begin_capture()
        step()
        graph = stream.end_capture()
        rows = []
        for it in range(args.iters + 10):
            tr.barrier(stream.ptr)
            trace.fill(0)
            graph.launch(stream)
            stream.synchronize()
            if it >= 10:
                rows.append(trace.get())
        a2a.synchronize(stream)
    rows = np.array(rows).reshape(len(rows), len(C.TRACE_HALVES), C.TRACE_POINTS)
    mhz = cupy.cuda.runtime.getDeviceProperties(tr.device)["clockRate"] / 1e3
    everyone = comm.allgather(figures(rows, mhz))
    if rank == 0:
        mode = "the four half kernels" if args.split else "one launch per phase"
        print(f"{args.transport}, {T} tokens per rank, {mode}, {args.iters} replays: microseconds since the previous "
              f"stamp, median (p90), SM clock {mhz:.0f} MHz")
        print(table(everyone))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(dict(transport=args.transport, tokens=T, split=args.split, iters=args.iters,
                               sm_clock_mhz=mhz, ranks=everyone), fh, indent=1)
    a2a.destroy()
    comm.finalize()


if __name__ == "__main__":
    main()
