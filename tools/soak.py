"""Soak: random dispatch + combine calls for N minutes with bad inputs injected on one rank at random;
every result is checked against moecomm.reference and every injected fault must raise on every rank.

    mpiexec -n 3 python tools/soak.py --minutes 5 [--transport host] [--json soak.json]
    mpirun -np 2 python tools/soak.py --minutes 5 --transport nvshmem

Each step draws, identically on every rank: one of four live AllToAlls (dtypes, scales, top-k differ),
a token count per rank, skewed or uniform routing with some -1 ids, split halves or not, router weights at
dispatch or at combine, and with probability --inject an injected fault on one rank: a refused argument
(a wrong dtype; InvalidArgument on that rank, PeerError on the others) or an expert id out of range
(InvalidRouting on every rank). After a fault the next valid call must be right again. Rank 0 prints
calls, mismatches (must be 0), faults injected against faults raised collectively, and resident / GPU
memory at the first and the last step. On GPUs the peers' errors are recorded by the kernels and raised by
synchronize() (here right after dispatch); the call is then still open there and is closed by its combine.
"""
import argparse
import json
import sys
import time

import numpy as np

import moecomm
from moecomm import reference
from moecomm._dtypes import IN_DTYPES, as_dtype

CONFIGS = (  # (experts per rank, top-k, hidden, scales, in dtype, out dtype, max tokens)
    (4, 2, 256, None, "bfloat16", "bfloat16", 32),
    (2, 1, 128, None, "float16", "float16", 16),
    (8, 4, 512, 4, "float8_e4m3fn", "bfloat16", 24),
    (4, 3, 256, None, "bfloat16", "float16", 8),
)


def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


class Arrays:
    """numpy on the host transport, CuPy on GPUs (raw bytes for dtypes CuPy lacks)."""

    def __init__(self, device):
        self.device = device
        if device:
            import cupy
            self.cp = cupy

    def put(self, a):
        if not self.device:
            return np.array(a)
        a = np.ascontiguousarray(a)
        raw = a.dtype if a.dtype.kind in "biuf" and a.dtype.name not in ("bfloat16", "float8_e4m3fn") \
            else np.dtype(f"u{a.dtype.itemsize}")
        return self.cp.asarray(a.view(raw))

    def get(self, a, dtype):
        return (a.get() if self.device else a).view(dtype)

    def gpu_mib(self):
        if not self.device:
            return 0.0
        free, total = self.cp.cuda.runtime.memGetInfo()
        return (total - free) / 2 ** 20


def draw(step, world, args):
    """The plan of one step, the same on every rank."""
    rng = np.random.default_rng([args.seed, step])
    c = int(rng.integers(len(CONFIGS)))
    per_rank, k, hidden, scales, in_dt, out_dt, max_m = CONFIGS[c]
    experts = per_rank * world
    ms = [int(v) for v in rng.integers(0, max_m + 1, world)]
    hot = rng.random() < 0.5
    idx = []
    for m in ms:
        p = np.ones(experts) if not hot else 1.0 / np.arange(1, experts + 1)
        ids = np.stack([rng.choice(experts, k, replace=False, p=p / p.sum()) for _ in range(m)]) if m else \
            np.zeros((0, k), np.int64)
        ids[rng.random(ids.shape) < 0.1] = -1
        idx.append(ids.astype(np.int32))
    dt = as_dtype(in_dt, IN_DTYPES, "in_dtype")
    x = [(rng.standard_normal((m, hidden)) * 2).astype(np.float32).astype(dt) for m in ms]
    xs = [rng.random((m, scales), np.float32) if scales else None for m in ms]
    w = [rng.random((m, k), np.float32) for m in ms]
    fault = None
    if rng.random() < args.inject:
        kinds = ["routing", "argument"]
        fault = (kinds[int(rng.integers(len(kinds)))], int(rng.integers(world)))
    return dict(config=c, ms=ms, idx=idx, x=x, xs=xs, w=w, split=bool(rng.random() < 0.3),
                weights_at_dispatch=bool(rng.random() < 0.7), fault=fault)


def run_step(comm, a2as, A, plan):
    """One dispatch + combine; returns (mismatch message or None, what it raised or None)."""
    W, r = comm.world_size, comm.rank
    a2a = a2as[plan["config"]]
    c = a2a.cfg
    L, cap, m = c.num_local_experts, c.expert_capacity, plan["ms"][r]
    idx = plan["idx"][r].copy()
    fault = plan["fault"]
    dp_x = A.put(plan["x"][r])
    if fault and fault[1] == r:
        if fault[0] == "routing" and m:
            idx[0, 0] = c.num_experts + 3
        elif fault[0] == "argument":
            dp_x = A.put(plan["x"][r].astype(np.float32) if m else np.zeros((0, c.hidden_dim), np.float32))
    scaled = c.hidden_dim_scale is not None
    n, ex = A.put(np.full(L, -1, np.int32)), A.put(np.zeros((L, cap, c.hidden_dim), c.in_dtype))
    es = A.put(np.zeros((L, cap, c.hidden_dim_scale), np.float32)) if scaled else None
    bound_m, idx_d, w_d = A.put(np.array([m], np.int32)), A.put(idx), A.put(plan["w"][r])
    dw = w_d if plan["weights_at_dispatch"] else None
    halves = ((True, False), (False, True)) if plan["split"] else ((True, True),)
    dispatched = False
    failed = (moecomm.InvalidArgument, moecomm.PeerError, moecomm.InvalidRouting)
    try:
        for send, recv in halves:
            a2a.dispatch(n, ex, es, dp_x, A.put(plan["xs"][r]) if scaled else None, idx_d, bound_m,
                         do_send=send, do_recv=recv, weights=dw)
        dispatched = True
        a2a.synchronize()
    except failed as e:
        if dispatched:  # raised by synchronize (GPU): the call is still open here, its combine closes it
            try:
                a2a.combine(A.put(np.zeros((m, c.hidden_dim), c.out_dtype)), idx_d, w_d, ex, bound_m)
                a2a.synchronize()
            except failed:
                pass
        return None, type(e).__name__
    counts = A.get(n, np.int32)
    ref = reference.dispatch(plan["x"], plan["xs"] if scaled else None, plan["idx"], c.num_experts, W,
                             c.max_num_tokens)
    if not np.array_equal(counts, ref[r]["expert_num_tokens"]):
        return f"counts {counts.tolist()} != {ref[r]['expert_num_tokens'].tolist()}", None
    got = A.get(ex, c.in_dtype)
    got_s = A.get(es, np.float32) if scaled else None
    for le in range(L):
        mine = (got[le], got_s[le] if scaled else None)
        want = (ref[r]["expert_x"][le], ref[r]["expert_x_scale"][le] if scaled else None)
        if not np.array_equal(reference.canonical_rows(int(counts[le]), *mine),
                              reference.canonical_rows(int(counts[le]), *want)):
            return f"expert {le} holds other tokens than the reference", None
    out = A.put(np.zeros((m, c.hidden_dim), c.out_dtype))
    y = A.put(got.astype(np.float32).astype(c.out_dtype))  # the expert: identity in the output dtype
    for send, recv in halves:
        a2a.combine(out, idx_d, None if dw is not None else w_d, y, bound_m, do_send=send, do_recv=recv)
    a2a.synchronize()
    ref_y = [q["expert_x"].astype(np.float32).astype(c.out_dtype) for q in ref]
    want = reference.combine(plan["idx"], plan["w"], ref_y, [q["origin"] for q in ref], c.num_experts, W,
                             np.float32)[r]
    mag = reference.combine(plan["idx"], [np.abs(v) for v in plan["w"]], [np.abs(v.astype(np.float32)) for v in ref_y],
                            [q["origin"] for q in ref], c.num_experts, W, np.float32)[r]
    diff = np.abs(A.get(out, c.out_dtype).astype(np.float32) - want)
    if (diff > 2 ** -6 * mag + 1e-6).any():
        return f"combined tokens differ (max diff {diff.max():.3g})", None
    return None, None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=1.0)
    p.add_argument("--transport", default="host", choices=["host", "nvshmem", "ipc"])
    p.add_argument("--inject", type=float, default=0.1, help="probability of a fault per step (default 0.1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the summary here (rank 0)")
    args = p.parse_args()
    comm = moecomm.init(transport=args.transport)
    A = Arrays(comm.transport.memory == "device")
    W = comm.world_size
    a2as = [moecomm.AllToAll(comm, max_m, per_rank * W, k, hidden, scales, in_dt, out_dt)
            for per_rank, k, hidden, scales, in_dt, out_dt, max_m in CONFIGS]
    t0, step, stats = time.monotonic(), 0, dict(calls=0, mismatches=0, injected=0, raised_everywhere=0)
    first, examples = None, []
    while True:
        if step % 20 == 0 and not all(comm.allgather(time.monotonic() - t0 < args.minutes * 60)):
            break
        plan = draw(step, W, args)
        mismatch, raised = run_step(comm, a2as, A, plan)
        expected = None
        if plan["fault"]:
            kind, bad = plan["fault"]
            if kind == "routing" and plan["ms"][bad] == 0:
                plan["fault"] = None  # no token to corrupt on that rank: a normal step
            else:
                expected = "InvalidRouting" if kind == "routing" else (
                    "InvalidArgument" if bad == comm.rank else "PeerError")
        outcomes = comm.allgather((raised, expected, mismatch))
        stats["calls"] += 1
        stats["mismatches"] += sum(mis is not None for _, _, mis in outcomes)
        if plan["fault"]:
            stats["injected"] += 1
            stats["raised_everywhere"] += all(got == want for got, want, _ in outcomes)
        if len(examples) < 10:
            examples += [f"step {step} rank {q}: {mis}" for q, (_, _, mis) in enumerate(outcomes) if mis]

        if step == 50:
            first = (rss_mib(), A.gpu_mib())
        step += 1
    last = (rss_mib(), A.gpu_mib())
    memory = comm.allgather((first, last))
    for a in a2as:
        a.destroy()
    if comm.rank == 0:
        summary = dict(transport=args.transport, ranks=W, minutes=args.minutes, **stats,
                       memory_mib=[dict(rank=q, rss_first=f[0], rss_last=l[0], gpu_first=f[1], gpu_last=l[1])
                                   for q, (f, l) in enumerate(memory) if f is not None], examples=examples)
        print(f"soak: {args.transport}, {W} ranks, {time.monotonic() - t0:.0f} s: {stats['calls']} calls, "
              f"{stats['mismatches']} mismatches, {stats['injected']} faults injected, "
              f"{stats['raised_everywhere']} raised as expected on every rank")
        for mm in summary["memory_mib"]:
            print(f"  rank {mm['rank']}: RSS {mm['rss_first']:.1f} -> {mm['rss_last']:.1f} MiB, "
                  f"GPU {mm['gpu_first']:.0f} -> {mm['gpu_last']:.0f} MiB")
        for e in examples:
            print("  MISMATCH", e)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)
    ok = stats["mismatches"] == 0 and stats["raised_everywhere"] == stats["injected"]
    comm.finalize()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
