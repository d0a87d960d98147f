"""What an SM budget (``AllToAll(max_sms=...)``) buys a GEMM on another stream, and what it costs us.

    mpirun -np 1 python tools/sm_budget.py [--budgets 0,44] [--configs r1-decode,r1-prefill] [--json sm-budget.json]

World size 1 on one GPU. For each configuration and budget (0: none) it checks one dispatch's counts (a
bincount of the ids) and one combine's rows (expert outputs of ones: each token's weights summed), then times,
with CUDA events:
* ours alone: a CUDA graph of dispatch() + combine() replayed (median and p99 per replay);
* the GEMM alone: a bf16 [N, N] @ [N, N] product on a stream of its own (median per product);
* both: the replays queued on one stream and the products on the other, so that they overlap; the GEMM's
  median per product then, and the share of its solo speed it keeps (solo / concurrent).
Routing is uniform; router weights go with dispatch. Writes the JSON (command, GPU, every figure).
"""
import argparse
import json
import platform
import sys

import numpy as np

import moecomm
from moecomm.bench import CONFIGS, routing, stats

GEMM_N = 4096


def events(cp, n):
    return [cp.cuda.Event() for _ in range(n + 1)]


def per_iter_us(cp, evs):
    return np.array([cp.cuda.get_elapsed_time(a, b) * 1e3 for a, b in zip(evs, evs[1:])])


def check(a2a, d, ids, w, experts):
    """One dispatch and combine: the counts are the ids' bincount, and with expert outputs of ones each token
    combines to the sum of its weights (in bf16)."""
    a2a.dispatch(d["n"], d["ex"], d["es"], d["x"], d["xs"], d["idx"], d["m"], weights=d["w"])
    a2a.combine(d["out"], d["idx"], None, d["y"], d["m"])
    a2a.synchronize()
    if not np.array_equal(d["n"].get(), np.bincount(ids.ravel(), minlength=experts)):
        raise SystemExit("sm_budget: dispatch counts differ from the ids' bincount")
    got = d["out"].get().view(moecomm.bfloat16).astype(np.float32)
    if not np.allclose(got, w.sum(axis=1, keepdims=True), rtol=2 ** -7, atol=0):
        raise SystemExit("sm_budget: combined rows differ from the weights' sums")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", default="0,44", help="max_sms values to compare (0: no cap)")
    p.add_argument("--configs", default="r1-decode,r1-prefill",
                   help=f"comma list of {', '.join(CONFIGS)} (moecomm.bench's shapes; default r1-decode,r1-prefill)")
    p.add_argument("--iters", type=int, default=300, help="graph replays / GEMMs timed alone")
    p.add_argument("--json", default="sm-budget.json", help="output JSON (default sm-budget.json)")
    p.add_argument("--transport", default="ipc", choices=["ipc", "nvshmem"], help="GPU transport (default ipc)")
    args = p.parse_args()
    import cupy as cp
    comm = moecomm.init(transport=args.transport)
    if comm.world_size != 1:
        raise SystemExit("sm_budget: world size 1 (one process on one GPU)")
    ours, theirs = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    ga = cp.ones((GEMM_N, GEMM_N), cp.float16)
    gb, gc = cp.ones_like(ga), cp.empty_like(ga)

    def gemms(n, evs=None):
        with theirs:
            for i in range(n):
                if evs:
                    evs[i].record(theirs)
                cp.matmul(ga, gb, out=gc)
            if evs:
                evs[n].record(theirs)

    gemms(20)
    evs = events(cp, args.iters)
    gemms(args.iters, evs)
    theirs.synchronize()
    solo = stats(per_iter_us(cp, evs))
    results = []
    for name in args.configs.split(","):
        tokens, experts, k, hidden, scales = CONFIGS[name]
        rng = np.random.default_rng([0, tokens])
        ids = routing(rng, tokens, k, experts, "uniform")
        x = rng.integers(0, 255, (tokens, hidden), np.uint8) & 0x77
        xs, w = rng.random((tokens, scales), np.float32), rng.random((tokens, k), np.float32)
        for budget in (int(b) for b in args.budgets.split(",")):
            a2a = moecomm.AllToAll(comm, tokens, experts, k, hidden, scales, "float8_e4m3fn", "bfloat16",
                                   max_sms=budget or None)
            rows = a2a.cfg.expert_x_shape()[:-1]
            d = dict(x=cp.asarray(x), xs=cp.asarray(xs), idx=cp.asarray(ids), w=cp.asarray(w),
                     m=cp.asarray(np.array([tokens], np.int32)), n=cp.zeros(experts, np.int32),
                     ex=cp.zeros(rows + (hidden,), np.uint8), es=cp.zeros(rows + (scales,), np.float32),
                     y=cp.full(rows + (hidden,), 0x3F80, np.uint16), out=cp.zeros((tokens, hidden), np.uint16))
            check(a2a, d, ids, w, experts)
            with ours:
                ours.begin_capture(cp.cuda.runtime.streamCaptureModeRelaxed)
                a2a.dispatch(d["n"], d["ex"], d["es"], d["x"], d["xs"], d["idx"], d["m"], weights=d["w"], stream=ours)
                a2a.combine(d["out"], d["idx"], None, d["y"], d["m"], stream=ours)
                graph = ours.end_capture()
            for _ in range(20):
                graph.launch(ours)
            evs = events(cp, args.iters)
            for i in range(args.iters):
                evs[i].record(ours)
                graph.launch(ours)
            evs[-1].record(ours)
            ours.synchronize()
            alone = stats(per_iter_us(cp, evs))
            # both: enough replays queued to cover the products (each side's median known), then the products
            n_gemm = max(50, args.iters // 3)
            replays = int(n_gemm * solo["median_us"] / alone["median_us"] * 2) + 50
            ours_evs, gemm_evs = events(cp, replays), events(cp, n_gemm)
            for i in range(replays):
                ours_evs[i].record(ours)
                graph.launch(ours)
            ours_evs[-1].record(ours)
            gemms(n_gemm, gemm_evs)
            ours.synchronize()
            theirs.synchronize()
            a2a.synchronize()
            # the products ran beside our replays from the first to the last (the replays began before them
            # and ended after them); our replays that ended while the products ran
            start, end = (cp.cuda.get_elapsed_time(ours_evs[0], e) for e in (gemm_evs[0], gemm_evs[-1]))
            covered = start >= 0 and cp.cuda.get_elapsed_time(gemm_evs[-1], ours_evs[-1]) >= 0
            beside = stats(per_iter_us(cp, gemm_evs))
            ends = np.array([cp.cuda.get_elapsed_time(ours_evs[0], e) for e in ours_evs[1:]])
            during = per_iter_us(cp, ours_evs)[(ends > start) & (ends <= end)]
            plan = a2a.stats()["plan"]  # the blocks of each phase's one launch
            grid = {phase: plan["grids"][kernels[0]] for phase, kernels in plan["whole"].items()}
            result = dict(config=name, tokens=tokens, max_sms=budget or None, grid_blocks=grid, ours_alone=alone,
                          ours_beside_gemm=stats(during) if len(during) else None, gemm_solo=solo,
                          gemm_beside_ours=beside, gemm_kept=solo["median_us"] / beside["median_us"],
                          overlap_covered=bool(covered))
            results.append(result)
            print(f"{name} max_sms={budget or 'none'}: ours alone {alone['median_us']:.1f} us (p99 "
                  f"{alone['p99_us']:.1f}); GEMM {GEMM_N}^3 alone {solo['median_us']:.1f} us, beside ours "
                  f"{beside['median_us']:.1f} us: keeps {100 * result['gemm_kept']:.0f} % "
                  f"(replays covered the products: {covered})", flush=True)
            a2a.destroy()
    gpu = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    doc = dict(command="python tools/sm_budget.py " + " ".join(sys.argv[1:]), gpu=gpu, host=platform.node(),
               transport=args.transport, gemm=f"float16 [{GEMM_N}, {GEMM_N}] @ [{GEMM_N}, {GEMM_N}] (cupy.matmul)",
               results=results)
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    comm.finalize()


if __name__ == "__main__":
    main()
