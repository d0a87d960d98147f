"""``python -m moecomm.loadtest``: load tests that reproduce router skew, on GPUs (``mpirun``) or CPU ranks
(``mpiexec``, host transport).

    mpiexec -n 2 python -m moecomm.loadtest --scenarios zipf,moving-hot,ramp --json load.json --plot load.png
    mpirun -np 2 python -m moecomm.loadtest --scenarios uniform,zipf,moving-hot,mixture,adversarial,ramp,topk,mask

Scenarios (every rank draws the same popularity, each rank its own tokens):

* ``uniform``, ``zipf``, ``moving-hot`` (Zipf whose hottest expert moves every ``--period`` steps),
  ``mixture`` (``--domains`` Zipf popularity profiles, standing in for languages or tasks, mixed with new
  weights every step), ``adversarial`` (a synthetic linear router and inputs searched so that one expert
  is in every token's top-k): ``--steps`` steps each. Tokens per rank per step: ``--tokens``, or with
  ``--lengths mixture`` short decode batches (1-8 tokens, 70 %) and long prompt chunks (half to all of
  ``--tokens``).
* ``ramp``: Zipf routing at 1, 2, 4, ... ``--tokens`` tokens per rank.
* ``topk``: Zipf routing with top-k 1, 2, 4, 8 (up to ``--topk``).
* ``capacity``: Zipf routing with a capacity of ``--capacity-factors`` times the mean demand per expert
  and ``overflow="drop"``: the share of (token, expert) pairs dropped, and the time.
* ``mask``: Zipf steps; the last rank stops answering mid-run; the others name it in a CommTimeout, mask it
  (``AllToAll.mask_ranks``) and keep serving; then it returns and is unmasked.

Per step: dispatch + combine time (host wall time on CPU ranks; on GPUs CUDA events around the eager calls,
each step starting at a device barrier so that the ranks' host skew is not counted; max over ranks), the
(token, expert) pairs per rank (max and mean over ranks), the imbalance max/mean, and the hot experts
(:mod:`moecomm.telemetry`). ``--ep-size`` splits the job into data-parallel replicas of ``ep-size`` ranks,
each with every expert: run once at full width and once narrower to compare EP width against replicas at
the same GPU count (the figures are those of the group of world rank 0). Output: a table, ``--json`` (command,
environment, per-step records, summaries) and ``--plot`` (imbalance and step time over the steps of each
scenario; time against tokens for ``ramp``).
With ``--spare-slots``, each routing scenario runs a second time with replicated experts: the first
``--replan`` steps on the static map, then replicas planned from the last ``--replan`` steps' load
(:func:`moecomm.balance.plan`, kept close to the map in use) and switched every ``--replan`` steps.
"""
import argparse
import json
import platform
import sys
import time

import numpy as np

from moecomm._mpi import wait_all

ROUTINGS = ("uniform", "zipf", "moving-hot", "mixture", "adversarial")
SCENARIOS = ROUTINGS + ("ramp", "topk", "capacity", "mask")
TAG_RETURN = 0x6E00  # plain MPI message that wakes the stalled rank of the mask scenario


# Routing generators: (rng of this rank and step, step, m tokens, E experts, top-k) -> ids [m, k] int32 ------
def _topk(rng, logp, k):
    """k distinct experts per row, drawn without replacement with probabilities exp(logp) (Gumbel top-k)."""
    g = logp - np.log(-np.log(rng.random(logp.shape)))
    return np.argsort(-g, axis=1)[:, :k].astype(np.int32)


def _zipf(E, a, seed, shift=0):
    """log-popularity of a Zipf(a) profile over a fixed permutation of the experts (rolled by ``shift``)."""
    perm = np.random.default_rng(seed).permutation(E)
    p = np.empty(E)
    p[perm] = 1.0 / np.arange(1, E + 1) ** a
    return np.log(np.roll(p / p.sum(), shift))


class Routing:
    """One routing generator; ``ids(rng, step, m)`` draws a step's expert ids on one rank."""

    def __init__(self, kind, E, k, args):
        self.kind, self.E, self.k, self.args = kind, E, k, args
        if kind == "mixture":
            self.profiles = np.stack([_zipf(E, args.zipf, args.seed + 1 + d) for d in range(args.domains)])
        if kind == "adversarial":
            self.router, self.target, self.alpha, self.hit = self._search()

    def _search(self):
        """A synthetic router (logits = x @ R) and the smallest push along one expert's column that puts
        that expert in the top-k of at least 95 % of random inputs (doubling search)."""
        rng = np.random.default_rng(self.args.seed)
        d = 64
        router = rng.standard_normal((d, self.E)) / np.sqrt(d)
        target = int(rng.integers(self.E))
        direction = router[:, target] / np.linalg.norm(router[:, target])
        alpha, hit = 0.125, 0.0
        while alpha < 64:
            x = rng.standard_normal((512, d)) + alpha * direction
            hit = float((np.argsort(-(x @ router), axis=1)[:, :self.k] == target).any(axis=1).mean())
            if hit >= 0.95:
                break
            alpha *= 2
        return router, target, alpha, hit

    def ids(self, rng, step, m):
        E, k, a = self.E, self.k, self.args
        if self.kind == "uniform":
            return _topk(rng, np.zeros((m, E)), k)
        if self.kind == "zipf":
            return _topk(rng, np.broadcast_to(_zipf(E, a.zipf, a.seed), (m, E)), k)
        if self.kind == "moving-hot":
            shift = (step // a.period) * max(1, E // 7)
            return _topk(rng, np.broadcast_to(_zipf(E, a.zipf, a.seed, shift), (m, E)), k)
        if self.kind == "mixture":
            weights = np.random.default_rng([a.seed, step]).dirichlet(np.ones(a.domains))  # the same on every rank
            domain = rng.choice(a.domains, size=m, p=weights)
            return _topk(rng, self.profiles[domain], k)
        if self.kind == "adversarial":
            d = self.router.shape[0]
            direction = self.router[:, self.target] / np.linalg.norm(self.router[:, self.target])
            x = rng.standard_normal((m, d)) + self.alpha * direction
            return np.argsort(-(x @ self.router), axis=1)[:, :k].astype(np.int32)
        raise ValueError(self.kind)


def tokens_per_step(rng, args):
    """This rank's token count for one step: --tokens, or the prompt-length mixture."""
    if args.lengths == "fixed":
        return args.tokens
    if rng.random() < 0.7:
        return int(rng.integers(1, min(8, args.tokens) + 1))
    return int(rng.integers(max(1, args.tokens // 2), args.tokens + 1))


# Running steps -------------------------------------------------------------------------------------
class Layer:
    """One AllToAll and its arrays for a top-k (with ``slots`` expert slots per rank: replicas through an
    expert map); ``step(ids, m)`` runs dispatch + combine (the expert is the identity) and returns (seconds,
    counts [num_local_experts])."""

    def __init__(self, comm, args, k, slots=None, capacity=None):
        import moecomm
        self.comm, self.k = comm, k
        self.gpu = comm.transport.memory == "device"
        if self.gpu:
            import cupy as xp
            self.xp, dt = xp, np.uint16  # bf16 as raw 16-bit words
        else:
            self.xp, dt = np, moecomm.bfloat16
        M, H = args.tokens, args.hidden
        self.a2a = moecomm.AllToAll(comm, M, args.experts, k, H, None, "bfloat16", "bfloat16", slots_per_rank=slots,
                                    capacity=capacity, overflow="drop")
        c = self.a2a.cfg
        xp = self.xp
        self.n, self.ex = xp.zeros(c.num_local_experts, np.int32), xp.zeros(c.expert_x_shape(), dt)
        self.x, self.out = xp.zeros((M, H), dt), xp.zeros((M, H), dt)
        self.w = xp.ones((M, k), np.float32)
        if self.gpu:
            self.events = (xp.cuda.Event(), xp.cuda.Event())
        self.align = True  # GPUs: start each timed step at a device barrier (not while a rank may stall)

    def step(self, ids, m):
        xp, a2a = self.xp, self.a2a
        M = self.x.shape[0]
        idx = np.full((M, self.k), -1, np.int32)
        idx[:m] = ids
        d_idx, bound = xp.asarray(idx), xp.array([m], np.int32)
        if self.gpu:
            if self.align:  # the ranks' host skew (routing draws, the per-step gather) is not the step's time
                self.comm.transport.barrier()
            self.events[0].record()
        t0 = time.perf_counter()
        a2a.dispatch(self.n, self.ex, None, self.x, None, d_idx, bound, weights=self.w)
        a2a.combine(self.out, d_idx, None, self.ex, bound)
        if self.gpu:
            self.events[1].record()
            self.events[1].synchronize()
            a2a.synchronize()
            seconds = xp.cuda.get_elapsed_time(*self.events) / 1e3
        else:
            seconds = time.perf_counter() - t0
        return seconds, np.asarray(self.n.get() if self.gpu else self.n).copy()

    def close(self):
        self.a2a.destroy()


def run_steps(comm, layer, routing, steps, args, first_step=0, replan=0):
    """``steps`` steps of ``routing``; returns this rank's (seconds [steps], counts [steps, L]). With
    ``replan`` (and a layer with expert slots), every ``replan`` steps the replicas are planned again from
    the load of the last ``replan`` steps (moecomm.balance.plan, kept close to the map in use) and switched."""
    from moecomm import balance
    times, counts = [], []
    for s in range(first_step, first_step + steps):
        if replan and s > first_step and (s - first_step) % replan == 0:
            window = np.concatenate(comm.allgather(np.array(counts[-replan:]), "loadtest replan"), axis=1)
            emap = layer.a2a.expert_map
            held = emap.slots.ravel()
            load = np.bincount(held[held >= 0], weights=window.sum(axis=0)[held >= 0], minlength=emap.num_experts)
            layer.a2a.set_expert_map(balance.plan(load, emap.num_ranks, emap.slots_per_rank, previous=emap).map)
        rng = np.random.default_rng([args.seed, comm.rank, s])
        m = tokens_per_step(rng, args)
        t, n = layer.step(routing.ids(rng, s, m), m)
        times.append(t)
        counts.append(n)
    return np.array(times), np.array(counts)


def gather_steps(comm, times, counts):
    """Every rank's per-step times and counts: (max time per step [steps], counts [steps, E])."""
    everyone = comm.allgather((times, counts), "loadtest")
    return (np.max([t for t, _ in everyone], axis=0) if len(times) else np.zeros(0),
            np.concatenate([c for _, c in everyone], axis=1))


def summarize_steps(name, times, counts, num_ranks):
    from moecomm import telemetry
    m = telemetry.summarize(counts, num_ranks)
    rank = counts.reshape(len(counts), num_ranks, -1).sum(axis=2)
    return {"scenario": name, "steps": len(times), "time_us": {
        "p50": float(np.median(times) * 1e6), "p99": float(np.percentile(times, 99) * 1e6)},
        "rank_tokens_max": float(rank.max(axis=1).mean()), "rank_tokens_mean": float(rank.mean()),
        "imbalance": {k: m["imbalance"][k] for k in ("mean", "p95", "max")},
        "hot_experts": m["hot"]["experts"][:8], "per_step": {
            "time_us": (times * 1e6).round(2).tolist(), "imbalance": m["imbalance"]["per_step"],
            "rank_tokens_max": rank.max(axis=1).tolist()}}


def scenario_mask(comm, layer, routing, args):
    """Zipf steps; the last rank stalls; the others time out naming it, mask it, serve, then take it back."""
    import moecomm
    world, last, third = comm.bootstrap.mpi, comm.world_size - 1, max(1, args.steps // 3)
    record = {"scenario": "mask", "ranks": comm.world_size}
    if comm.world_size < 2:
        return dict(record, skipped="needs at least 2 ranks (one stalls, the others mask it)")
    layer.align = False  # a device barrier would wait for the stalled rank too
    times, counts = run_steps(comm, layer, routing, third, args)
    if comm.rank == last:  # stalled until called back (bounded: the others detect, mask and serve meanwhile)
        deadline = time.monotonic() + 20 * comm.timeout_s + 120
        while not world.iprobe(source=0, tag=TAG_RETURN):
            if time.monotonic() > deadline:
                raise moecomm.CommTimeout("loadtest mask: rank 0 never called the stalled rank back", peer=0,
                                          phase="mask")
            time.sleep(1e-3)
        world.recv(source=0, tag=TAG_RETURN)
    else:
        t0 = time.perf_counter()
        try:
            run_steps(comm, layer, routing, 1, args, third)
            record["detected"] = "no error"
        except moecomm.CommTimeout as e:
            record["detected"] = f"CommTimeout naming rank {e.peer} after {time.perf_counter() - t0:.2f} s"
        layer.a2a.mask_ranks([last])
        masked_t, _ = run_steps(comm, layer, routing, third, args, third + 1)
        record["masked_time_us_p50"] = float(np.median(masked_t) * 1e6)
        record["masked_pairs"] = layer.a2a.stats()["MASKED_PAIRS"]
        if comm.rank == 0:
            world.send(None, dest=last, tag=TAG_RETURN)
    layer.a2a.mask_ranks([])
    after_t, after_c = run_steps(comm, layer, routing, third, args, 2 * third + 1)
    record.update(before_time_us_p50=float(np.median(times) * 1e6), after_time_us_p50=float(np.median(after_t) * 1e6))
    everyone = world.allgather(record)  # plain MPI: the communicator serves only through the masked AllToAll now
    return dict(everyone[0], survivors=[dict(r, rank=q) for q, r in enumerate(everyone) if "detected" in r])


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m moecomm.loadtest", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default="uniform,zipf,moving-hot,ramp")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--tokens", type=int, default=128, help="most tokens per rank per step (default 128)")
    p.add_argument("--lengths", choices=["fixed", "mixture"], default="fixed")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--zipf", type=float, default=1.2, help="Zipf exponent (default 1.2)")
    p.add_argument("--period", type=int, default=20, help="steps a hot expert stays hot (moving-hot)")
    p.add_argument("--domains", type=int, default=4, help="popularity profiles mixed per step (mixture)")
    p.add_argument("--ep-size", type=int, default=0, help="ranks per expert-parallel group (default: all)")
    p.add_argument("--spare-slots", type=int, default=0,
                   help="expert slots per rank beyond experts/ranks: each routing scenario also runs with replicas "
                        "planned from the load and re-planned every --replan steps")
    p.add_argument("--replan", type=int, default=20, help="steps between replica plans (default 20)")
    p.add_argument("--capacity-factors", default="1,1.5,2,4",
                   help="capacities, in multiples of the mean demand per expert (capacity scenario)")
    p.add_argument("--transport", default="auto")
    p.add_argument("--timeout", type=float, default=None, help="seconds any wait may last (mask: time to detect)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="loadtest.json")
    p.add_argument("--plot", default="loadtest.png")
    args = p.parse_args(argv)
    names = [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown or not names:
        p.error(f"unknown scenario(s) {unknown}; expected some of {','.join(SCENARIOS)}")
    names.sort(key=lambda s: s == "mask")  # last: it leaves the communicator serving through one AllToAll
    import moecomm
    from moecomm import balance
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    ep = args.ep_size or world.Get_size()
    if world.Get_size() % ep or args.experts % ep or not 1 <= args.topk <= min(16, args.experts):
        p.error(f"--ep-size {ep} must divide the ranks ({world.Get_size()}) and --experts ({args.experts}); "
                f"--topk must be in [1, min(16, experts)]")
    group = world.Split(world.Get_rank() // ep, world.Get_rank())
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        comm = moecomm.init(comm=group, transport=args.transport, timeout=args.timeout,
                            device=node.Get_rank() if ep < world.Get_size() else None)
    except moecomm.MoeCommError as e:
        p.exit(1, f"{p.prog}: {e}\n")
    results, first = [], world.Get_rank() == 0
    layers = {}

    def layer(k, slots=None, capacity=None):
        if (k, slots, capacity) not in layers:
            layers[(k, slots, capacity)] = Layer(comm, args, k, slots, capacity)
        return layers[(k, slots, capacity)]

    slots = args.experts // comm.world_size + args.spare_slots if args.spare_slots else None

    for name in names:
        t0 = time.time()
        if name in ROUTINGS:
            routing = Routing(name, args.experts, args.topk, args)
            times, counts = gather_steps(comm, *run_steps(comm, layer(args.topk), routing, args.steps, args))
            r = summarize_steps(name, times, counts, comm.world_size)
            if name == "adversarial":
                r["target"] = {"expert": routing.target, "push": routing.alpha, "hit_rate": routing.hit}
            if slots:  # the same steps with planned replicas, re-planned every --replan steps
                lay = layer(args.topk, slots)
                emap = lay.a2a.expert_map
                if emap.generation:  # start from the static map again (a previous scenario planned this one)
                    lay.a2a.set_expert_map(balance.ExpertMap.static(args.experts, comm.world_size, slots,
                                                                    generation=emap.generation + 1))
                before = lay.a2a.expert_map.generation
                times, counts = gather_steps(comm, *run_steps(comm, lay, routing, args.steps, args, replan=args.replan))
                r["replicas"] = dict(summarize_steps(f"{name} + replicas", times, counts, comm.world_size),
                                     slots_per_rank=slots, replan=args.replan,
                                     switches=lay.a2a.expert_map.generation - before)
        elif name == "ramp":
            routing, r = Routing("zipf", args.experts, args.topk, args), {"scenario": "ramp", "points": []}
            lay, saved, size = layer(args.topk), args.tokens, 1  # the layer keeps the full capacity
            while size <= saved:
                args.tokens = size  # every step at this size
                times, counts = gather_steps(comm, *run_steps(comm, lay, routing, args.steps, args))
                r["points"].append(dict(summarize_steps(f"ramp {size}", times, counts, comm.world_size), tokens=size))
                size *= 2
            args.tokens = saved
        elif name == "topk":
            r = {"scenario": "topk", "points": []}
            for k in (k for k in (1, 2, 4, 8, 16) if k <= args.topk):
                routing = Routing("zipf", args.experts, k, args)
                times, counts = gather_steps(comm, *run_steps(comm, layer(k), routing, args.steps, args))
                r["points"].append(dict(summarize_steps(f"topk {k}", times, counts, comm.world_size), topk=k))
        elif name == "capacity":
            r, routing = {"scenario": "capacity", "points": []}, Routing("zipf", args.experts, args.topk, args)
            mean = args.tokens * comm.world_size * args.topk / args.experts  # pairs per expert per step, at most
            for factor in (float(f) for f in args.capacity_factors.split(",")):
                cap = max(1, min(args.tokens * comm.world_size, int(np.ceil(factor * mean))))
                lay = layer(args.topk, capacity=cap)
                before = lay.a2a.stats()["DROPPED_PAIRS"]
                times, counts = gather_steps(comm, *run_steps(comm, lay, routing, args.steps, args))
                dropped = sum(comm.allgather(lay.a2a.stats()["DROPPED_PAIRS"] - before, "loadtest"))
                point = dict(summarize_steps(f"capacity {factor:g}x", times, counts, comm.world_size), factor=factor,
                             capacity=cap, dropped_pairs=dropped)
                point["dropped_share"] = dropped / max(1, dropped + int(counts.sum()))
                r["points"].append(point)
        else:
            r = scenario_mask(comm, layer(args.topk), Routing("zipf", args.experts, args.topk, args), args)
        r["seconds"] = round(time.time() - t0, 1)
        results.append(r)
        if first:
            print(_line(r), flush=True)
    if first:
        doc = {"command": "python -m moecomm.loadtest " + " ".join(argv if argv is not None else sys.argv[1:]),
               "ranks": world.Get_size(), "ep_size": ep, "transport": comm.transport.name,
               "host": platform.node(), "python": platform.python_version(), "numpy": np.__version__,
               "moecomm": getattr(moecomm, "__version__", "0.1.0"), "args": vars(args), "results": results}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}" + (f" and {args.plot}" if plot(results, args.plot) else " (no plot: matplotlib)"))
    if comm.broken is None:  # the mask scenario leaves it serving only through its AllToAll
        for lay in layers.values():
            lay.close()
    # every rank waits (bounded) for rank 0's files: a rank that ends a broken communicator exits at once, and
    # the launcher may then stop the others
    wait_all([world.Ibarrier()], [0], time.monotonic() + 120, 120, "loadtest: waiting for rank 0's output")
    comm.finalize()
    return 0


def _line(r):
    if "skipped" in r:
        return f"{r['scenario']:<12} skipped: {r['skipped']}"
    if r["scenario"] == "capacity":
        return f"{'capacity':<12} " + "  ".join(
            f"{pt['factor']:g}x ({pt['capacity']} slots): {pt['dropped_share']:.1%} dropped, "
            f"{pt['time_us']['p50']:.0f} us" for pt in r["points"])
    if "replicas" in r:
        rr = r["replicas"]
        return (_line({k: v for k, v in r.items() if k != "replicas"}) + f"\n{'  replicas':<12} p50 "
                f"{rr['time_us']['p50']:.0f} us  p99 {rr['time_us']['p99']:.0f} us  rank tokens max "
                f"{rr['rank_tokens_max']:.0f}  imbalance mean {rr['imbalance']['mean']:.2f} max "
                f"{rr['imbalance']['max']:.2f} ({rr['slots_per_rank']} slots per rank, re-planned every "
                f"{rr['replan']} steps)")
    if "points" in r:
        return f"{r['scenario']:<12} " + "  ".join(
            f"{pt.get('tokens', pt.get('topk'))}: {pt['time_us']['p50']:.0f} us" for pt in r["points"])
    if r["scenario"] == "mask":
        return (f"{'mask':<12} {r.get('detected', 'stalled rank')}; p50 {r['before_time_us_p50']:.0f} us before, "
                f"{r.get('masked_time_us_p50', float('nan')):.0f} masked, {r['after_time_us_p50']:.0f} after")
    target = (f"  target expert {r['target']['expert']} in the top-k of {r['target']['hit_rate']:.0%} of searched "
              f"inputs") if "target" in r else ""
    return (f"{r['scenario']:<12} p50 {r['time_us']['p50']:.0f} us  p99 {r['time_us']['p99']:.0f} us  "
            f"rank tokens max {r['rank_tokens_max']:.0f} / mean {r['rank_tokens_mean']:.0f}  "
            f"imbalance mean {r['imbalance']['mean']:.2f} max {r['imbalance']['max']:.2f}  hot {r['hot_experts']}"
            + target)


def plot(results, path):
    """Per routing scenario (and its replicas run, dashed): imbalance and step time over the steps, the
    step-time CDF and the busiest rank's pairs per step; time against tokens for ramp when it ran."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = [(x, "--" if x is not r else "-") for r in results if "per_step" in r for x in (r, r.get("replicas")) if x]
    ramp = next((r for r in results if r["scenario"] == "ramp"), None)
    n = 5 if ramp else 4
    fig, axes = plt.subplots(2, 3 if ramp else 2, figsize=(15 if ramp else 11, 8))
    axes = axes.ravel()
    for x, ls in runs:
        ps, name = x["per_step"], x["scenario"]
        t = np.sort(ps["time_us"])
        axes[0].plot(ps["imbalance"], label=name, ls=ls)
        axes[1].plot(ps["time_us"], label=name, ls=ls)
        axes[2].plot(t, np.arange(1, t.size + 1) / t.size, label=name, ls=ls)
        axes[3].plot(ps["rank_tokens_max"], label=name, ls=ls)
    axes[0].set(xlabel="step", ylabel="max / mean rank load", title="imbalance per step")
    axes[1].set(xlabel="step", ylabel="dispatch + combine (us, max over ranks)", title="step time", yscale="log")
    axes[2].set(xlabel="dispatch + combine (us)", ylabel="fraction of steps", title="step time CDF", xscale="log")
    axes[3].set(xlabel="step", ylabel="(token, expert) pairs", title="busiest rank's pairs per step")
    if ramp:
        t = [pt["tokens"] for pt in ramp["points"]]
        axes[4].plot(t, [pt["time_us"]["p50"] for pt in ramp["points"]], "o-", label="p50")
        axes[4].plot(t, [pt["time_us"]["p99"] for pt in ramp["points"]], "s--", label="p99")
        axes[4].set(xlabel="tokens per rank", ylabel="us", title="ramp (zipf)", xscale="log")
    for i, ax in enumerate(axes):
        if i >= n:
            ax.axis("off")
            continue
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


if __name__ == "__main__":
    sys.exit(main())
