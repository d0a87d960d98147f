"""Soak: random dispatch + combine calls for N minutes with faults injected on one rank at random; every
result is checked against moecomm.reference and every injected fault must raise on every rank.

    mpiexec -n 3 python tools/soak.py --minutes 5 [--transport host] [--json soak.json]
    mpirun -np 2 python tools/soak.py --minutes 5 --transport nvshmem

Each step draws, identically on every rank: one of four live AllToAlls (dtypes, scales, top-k differ;
on the host transport three more: the packed layout and a padded one with capacities below the demand of
hot steps and overflow="drop", and replicated experts whose map is switched at random, 1 step in 10),
a token count per rank, skewed or uniform routing with some -1 ids, split halves or not, router weights at
dispatch or at combine, and with probability --inject an injected fault on one rank:

* ``argument``: a refused argument (a wrong dtype; InvalidArgument on that rank, PeerError on the others);
* ``routing``: an expert id out of range (InvalidRouting on every rank);
* ``app``: the application fails between dispatch and combine (that rank reports it with ``a2a.abort()``:
  its next dispatch would too, but the soak's own gather of each step's outcome comes first; PeerError on the
  others);
* ``weights``: router weights sent with dispatch, and that rank also gives them to combine (InvalidArgument on
  every rank);
* ``ids``: that rank gives combine other expert ids than its dispatch (InvalidArgument there, PeerError on the
  others);
* ``thread``: that rank makes its dispatch from a second thread while its main thread calls synchronize() over
  and over: each call that meets the dispatch in progress is refused (ConcurrentCall) and harms nothing; the
  step is right on every rank.

A combine that raises PeerError must not return plausible rows: on GPUs, where the kernels found the call failed,
every row is NaN (the step in which a rank failed between the phases is the case a combine once summed another
step's rows for); on the host transport they are left as they were.

Every step's tokens are fresh, so a call that returned another step's data fails the comparison with the
reference (with the dropped pairs, combine's out_dropped and the map's replicas). After a fault the next call
must be right again. Every 50 steps every rank destroys one AllToAll with a dispatch send half posted and
builds it again. At the end, with --leave, the last rank returns from a function holding its communicator
while the others are in a call: they must raise PeerExited within about a second, and every process exits 0.
Rank 0 prints calls, mismatches (must be 0), faults injected against faults raised on every rank as
expected, and resident / GPU memory at step 50 and at the last step. On GPUs the peers' errors are recorded
by the kernels and raised by synchronize() (here right after dispatch, which ends the call on that rank).
"""
import argparse
import json
import sys
import threading
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
# Host transport only: the checks below compare the exact dropped pairs (reference.dropped; the kernels drop in
# arrival order, checked per expert by tests/mpi_capacity.py) and the packed layout: AllToAll keyword arguments
# per extra configuration, ranks' capacities in units of max tokens (a capacity below the demand of hot
# steps, so that pairs are dropped), and replicated experts whose map the soak switches at random.
HOST_CONFIGS = (
    ((4, 2, 256, None, "bfloat16", "bfloat16", 32), dict(layout="packed", overflow="drop"), 1),
    ((4, 3, 128, 2, "float8_e4m3fn", "float16", 16), dict(overflow="drop"), 0.5),
    ((2, 2, 128, None, "float16", "float16", 16), dict(slots_per_rank=3), None),
)


FAULTS = ("routing", "argument", "app", "weights", "ids", "thread")
REFUSED = [0]  # ConcurrentCall refusals of the thread fault on this rank


class AppError(Exception):
    """The application's own failure between dispatch and combine (an injected fault)."""


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


def draw(step, world, args, configs):
    """The plan of one step, the same on every rank."""
    rng = np.random.default_rng([args.seed, step])
    c = int(rng.integers(len(configs)))
    per_rank, k, hidden, scales, in_dt, out_dt, max_m = configs[c]
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
    weights_at_dispatch = bool(rng.random() < 0.7)
    if rng.random() < args.inject:
        fault = (FAULTS[int(rng.integers(len(FAULTS)))], int(rng.integers(world)))
        if fault[0] == "weights":
            weights_at_dispatch = True
    return dict(config=c, ms=ms, idx=idx, x=x, xs=xs, w=w, split=bool(rng.random() < 0.3),
                weights_at_dispatch=weights_at_dispatch, fault=fault, switch=bool(rng.random() < 0.1),
                switch_seed=int(rng.integers(1 << 30)))


def applies(plan, W):
    """Whether the plan's fault can be injected on its rank: a token to corrupt (routing), an expert id to
    change (ids), another rank to disagree with (weights)."""
    kind, bad = plan["fault"]
    return {"routing": plan["ms"][bad] > 0, "ids": bool((plan["idx"][bad] >= 0).any()),
            "weights": W > 1}.get(kind, True)


def rebuild_posted(a2a, build, A):
    """Every rank destroys ``a2a`` with a dispatch send half posted (no tokens); returns ``build()``."""
    c = a2a.cfg
    L, T, H = c.num_local_experts, c.max_num_tokens, c.hidden_dim
    scaled = c.hidden_dim_scale is not None
    a2a.dispatch(A.put(np.zeros(L, np.int32)), A.put(np.zeros(c.expert_x_shape(), c.in_dtype)),
                 A.put(np.zeros(c.expert_x_scale_shape(), np.float32)) if scaled else None,
                 A.put(np.zeros((T, H), c.in_dtype)),
                 A.put(np.zeros((T, c.hidden_dim_scale), np.float32)) if scaled else None,
                 A.put(np.full((T, c.experts_per_token), -1, np.int32)), A.put(np.zeros(1, np.int32)), do_recv=False,
                 out_expert_offsets=A.put(np.zeros(L + 1, np.int32)) if c.layout == "packed" else None)
    a2a.destroy()
    return build()


def switch_map(a2a, seed):
    """Replicas planned for a random load (the same on every rank), switched in (collective)."""
    from moecomm import balance
    emap = a2a.expert_map
    load = np.random.default_rng(seed).zipf(1.3, emap.num_experts).astype(float)
    a2a.set_expert_map(balance.plan(load, emap.num_ranks, emap.slots_per_rank, previous=emap).map)


def expected(a2a, plan, W):
    """The reference for this call on every rank: (ids as the reference sees them, reference dispatch,
    dropped pairs per rank, experts as the reference counts them)."""
    c = a2a.cfg
    ids = plan["idx"]
    E = c.num_experts
    if a2a.expert_map is not None:  # logical -> physical slots, by the map's rule
        ids = [a2a.expert_map.physical(i, np.arange(len(i)), q) for q, i in enumerate(ids)]
        E = W * c.num_local_experts
    drops = [np.zeros(i.shape, bool) for i in ids]
    if c.capacity is not None:
        drops = reference.dropped(ids, E, W, c.capacity, per_rank=c.layout == "packed")
    kept = [np.where(d, -1, i) for d, i in zip(drops, ids)]
    ref = reference.dispatch(plan["x"], plan["xs"] if c.hidden_dim_scale else None, kept, E, W, c.max_num_tokens)
    return kept, ref, drops, E


def run_step(comm, a2as, A, plan):
    """One dispatch + combine; returns (mismatch message or None, what it raised or None)."""
    W, r = comm.world_size, comm.rank
    a2a = a2as[plan["config"]]
    c = a2a.cfg
    if a2a.expert_map is not None and plan["switch"]:
        switch_map(a2a, plan["switch_seed"])
    L, m = c.num_local_experts, plan["ms"][r]
    packed = c.layout == "packed"
    idx = plan["idx"][r].copy()
    fault = plan["fault"]
    kind = fault[0] if fault and fault[1] == r else None  # this rank's fault
    dp_x = A.put(plan["x"][r])
    if kind == "routing" and m:
        idx[0, 0] = c.num_experts + 3
    elif kind == "argument":
        dp_x = A.put(plan["x"][r].astype(np.float32) if m else np.zeros((0, c.hidden_dim), np.float32))
    scaled = c.hidden_dim_scale is not None
    n, ex = A.put(np.full(L, -1, np.int32)), A.put(np.zeros(c.expert_x_shape(), c.in_dtype))
    es = A.put(np.zeros(c.expert_x_scale_shape(), np.float32)) if scaled else None
    off = A.put(np.full(L + 1, -1, np.int32)) if packed else None
    bound_m, idx_d, w_d = A.put(np.array([m], np.int32)), A.put(idx), A.put(plan["w"][r])
    combine_idx = idx_d
    if kind == "ids" and (idx >= 0).any():  # one pair fewer than dispatched
        other = idx.copy()
        other[tuple(np.argwhere(idx >= 0)[0])] = -1
        combine_idx = A.put(other)
    dw = w_d if plan["weights_at_dispatch"] else None
    halves = ((True, False), (False, True)) if plan["split"] else ((True, True),)
    failed = (moecomm.InvalidArgument, moecomm.PeerError, moecomm.InvalidRouting)
    def dispatch():
        for send, recv in halves:
            a2a.dispatch(n, ex, es, dp_x, A.put(plan["xs"][r]) if scaled else None, idx_d, bound_m,
                         do_send=send, do_recv=recv, weights=dw, out_expert_offsets=off)

    try:
        if kind == "thread":
            problem = beside_a_thread(a2a, dispatch)
            if problem:
                return problem, None
        else:
            dispatch()
        a2a.synchronize()
    except failed as e:  # the call is over on this rank (on GPUs synchronize() ended it)
        return None, type(e).__name__
    if kind == "app":  # between the phases
        a2a.abort()
        return None, "AppError"
    counts = A.get(n, np.int32)
    kept, ref, drops, E = expected(a2a, plan, W)
    if not np.array_equal(counts, ref[r]["expert_num_tokens"]):
        return f"counts {counts.tolist()} != {ref[r]['expert_num_tokens'].tolist()}", None
    got = A.get(ex, c.in_dtype)
    got_s = A.get(es, np.float32) if scaled else None
    if packed:
        rows = np.concatenate([[0], np.cumsum(counts)])
        if not np.array_equal(A.get(off, np.int32), rows):
            return f"offsets {A.get(off, np.int32).tolist()} != {rows.tolist()}", None
    for le in range(L):
        seg = slice(rows[le], rows[le + 1]) if packed else le
        mine = (got[seg], got_s[seg] if scaled else None)
        want = (ref[r]["expert_x"][le], ref[r]["expert_x_scale"][le] if scaled else None)
        if not np.array_equal(reference.canonical_rows(int(counts[le]), *mine),
                              reference.canonical_rows(int(counts[le]), *want)):
            return f"expert {le} holds other tokens than the reference", None
    out = A.put(np.zeros((m, c.hidden_dim), c.out_dtype))
    y = A.put(got.astype(np.float32).astype(c.out_dtype))  # the expert: identity in the output dtype
    dropped = A.put(np.zeros((m, c.experts_per_token), np.uint8)) if not A.device else None
    cw = w_d if dw is None or kind == "weights" else None
    try:
        for send, recv in halves:
            a2a.combine(out, combine_idx, cw, y, bound_m, do_send=send, do_recv=recv, out_dropped=dropped)
        a2a.synchronize()
    except failed as e:
        rows = A.get(out, c.out_dtype).astype(np.float32)
        if isinstance(e, moecomm.PeerError) and not (np.isnan(rows).all() if A.device else (rows == 0).all()):
            return f"a combine that raised PeerError returned plausible rows ({e})", type(e).__name__
        return None, type(e).__name__
    if dropped is not None and not np.array_equal(dropped.astype(bool), drops[r]):
        return "out_dropped differs from the reference's dropped pairs", None
    ref_y = [q["expert_x"].astype(np.float32).astype(c.out_dtype) for q in ref]
    want = reference.combine(kept, plan["w"], ref_y, [q["origin"] for q in ref], E, W, np.float32)[r]
    mag = reference.combine(kept, [np.abs(v) for v in plan["w"]], [np.abs(v.astype(np.float32)) for v in ref_y],
                            [q["origin"] for q in ref], E, W, np.float32)[r]
    diff = np.abs(A.get(out, c.out_dtype).astype(np.float32) - want)
    if (diff > 2 ** -6 * mag + 1e-6).any():
        return f"combined tokens differ (max diff {diff.max():.3g})", None
    return None, None


def beside_a_thread(a2a, call):
    """Run ``call`` (this step's dispatch) in a second thread while this one calls a2a.synchronize() until it
    is over; returns a problem (text) or None. A synchronize that meets the dispatch in progress must raise
    ConcurrentCall; between the halves it is legal and harmless (nothing failed this step)."""
    problems = []

    def worker():
        try:
            call()
        except Exception as e:  # noqa: BLE001 - reported as the step's problem
            problems.append(f"the dispatch in a second thread raised {type(e).__name__}: {e}")

    t = threading.Thread(target=worker)
    t.start()
    while t.is_alive():
        try:
            a2a.synchronize()
        except moecomm.ConcurrentCall:
            REFUSED[0] += 1
        except Exception as e:  # noqa: BLE001 - reported as the step's problem
            problems.append(f"synchronize() beside a dispatch in another thread raised {type(e).__name__}: {e}")
            break
        time.sleep(1e-4)
    t.join()
    return problems[0] if problems else None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=1.0, help="how long to run (default 1)")
    p.add_argument("--transport", default="host", choices=["host", "nvshmem", "ipc"], help="transport (default host)")
    p.add_argument("--inject", type=float, default=0.1, help="probability of a fault per step (default 0.1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the routing and the faults (default 0)")
    p.add_argument("--json", help="write the summary here (rank 0)")
    p.add_argument("--no-leave", dest="leave", action="store_false",
                   help="leave out the last check (the last rank returns from main() while the others are in a call)")
    args = p.parse_args()
    comm = moecomm.init(transport=args.transport)
    A = Arrays(comm.transport.memory == "device")
    W = comm.world_size
    configs, options = list(CONFIGS), [{}] * len(CONFIGS)
    if comm.transport.memory == "host":
        for config, kwargs, capacity in HOST_CONFIGS:
            configs.append(config)
            options.append(dict(kwargs, **({"capacity": max(1, int(capacity * config[6] * (
                config[1] if kwargs.get("layout") == "packed" else 1)))} if capacity else {})))
    def builder(per_rank, k, hidden, scales, in_dt, out_dt, max_m, kw):
        return lambda: moecomm.AllToAll(comm, max_m, per_rank * W, k, hidden, scales, in_dt, out_dt, **kw)
    builds = [builder(*config, kw) for config, kw in zip(configs, options)]
    a2as = [build() for build in builds]
    t0, step, stats = time.monotonic(), 0, dict(calls=0, mismatches=0, injected=0, raised_everywhere=0,
                                                by_kind={kind: [0, 0] for kind in FAULTS})
    first, examples = None, []
    while True:
        if step % 20 == 0 and not all(comm.allgather(time.monotonic() - t0 < args.minutes * 60)):
            break
        plan = draw(step, W, args, configs)
        if plan["fault"] and not applies(plan, W):
            plan["fault"] = None  # nothing to inject on that rank this step: a normal step
        mismatch, raised = run_step(comm, a2as, A, plan)
        expected = None
        if plan["fault"]:
            kind, bad = plan["fault"]
            here = bad == comm.rank
            expected = {"routing": "InvalidRouting", "weights": "InvalidArgument",
                        "argument": "InvalidArgument" if here else "PeerError",
                        "ids": "InvalidArgument" if here else "PeerError",
                        "app": "AppError" if here else "PeerError", "thread": None}[kind]
        outcomes = comm.allgather((raised, expected, mismatch))
        stats["calls"] += 1
        stats["mismatches"] += sum(mis is not None for _, _, mis in outcomes)
        if plan["fault"]:
            everywhere = all(got == want for got, want, _ in outcomes)
            stats["injected"] += 1
            stats["raised_everywhere"] += everywhere
            stats["by_kind"][plan["fault"][0]][0] += 1
            stats["by_kind"][plan["fault"][0]][1] += everywhere
            if not everywhere and len(examples) < 10:
                examples.append(f"step {step}: fault {plan['fault'][:2]}: (raised, expected) by rank "
                                f"{[(got, want) for got, want, _ in outcomes]}")
        if len(examples) < 10:
            examples += [f"step {step} rank {q}: {mis}" for q, (_, _, mis) in enumerate(outcomes) if mis]

        if step % 50 == 49:
            i = step // 50 % len(a2as)
            a2as[i] = rebuild_posted(a2as[i], builds[i], A)
        if step == 50:
            first = (rss_mib(), A.gpu_mib())
        step += 1
    last = (rss_mib(), A.gpu_mib())
    memory = comm.allgather((first, last))
    stats["thread_refusals"] = sum(comm.allgather(REFUSED[0]))
    for a in a2as[1:]:
        a.destroy()
    left = None  # (what it raised, the rank named, seconds) on the ranks that stayed
    if args.leave and W > 1:
        if comm.rank == W - 1:
            return 0  # out of main(), its communicator a local here: finalized at exit, its peers told
        left = leave_check(comm, a2as, A, args, step)
        print(f"soak: rank {comm.rank}: rank {W - 1} left from main() during a call: {left[0]} naming rank "
              f"{left[1]} after {left[2]:.3f} s", flush=True)
    if comm.rank == 0:
        summary = dict(transport=args.transport, ranks=W, minutes=args.minutes, **stats,
                       memory_mib=[dict(rank=q, rss_first=f[0], rss_last=e[0], gpu_first=f[1], gpu_last=e[1])
                                   for q, (f, e) in enumerate(memory) if f is not None], examples=examples)
        print(f"soak: {args.transport}, {W} ranks, {time.monotonic() - t0:.0f} s: {stats['calls']} calls, "
              f"{stats['mismatches']} mismatches, {stats['injected']} faults injected, "
              f"{stats['raised_everywhere']} raised as expected on every rank")
        print("  by kind (injected, raised as expected): " +
              ", ".join(f"{k} {n} / {ok}" for k, (n, ok) in stats["by_kind"].items()) +
              f"; {stats['thread_refusals']} calls refused beside another thread's dispatch")
        for mm in summary["memory_mib"]:
            print(f"  rank {mm['rank']}: RSS {mm['rss_first']:.1f} -> {mm['rss_last']:.1f} MiB, "
                  f"GPU {mm['gpu_first']:.0f} -> {mm['gpu_last']:.0f} MiB")
        for e in examples:
            print("  MISMATCH", e)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)
    ok = stats["mismatches"] == 0 and stats["raised_everywhere"] == stats["injected"]
    ok = ok and (left is None or (left[:2] == ("PeerExited", W - 1) and left[2] <= 1.5))
    comm.finalize()
    return 0 if ok else 1


def leave_check(comm, a2as, A, args, step):
    """A step on the first AllToAll while the last rank has left: (what it raised, the peer named, seconds)."""
    plan = dict(draw(step, comm.world_size, args, CONFIGS[:1]), fault=None)
    t0 = time.monotonic()
    try:
        _, raised = run_step(comm, a2as, A, plan)
    except moecomm.MoeCommError as e:
        return type(e).__name__, getattr(e, "peer", None), time.monotonic() - t0
    return raised, None, time.monotonic() - t0


if __name__ == "__main__":
    sys.exit(main())
