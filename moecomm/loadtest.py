"""``python -m moecomm.loadtest``: load tests that reproduce router skew, on GPUs (``mpirun``) or CPU ranks
(``mpiexec``, host transport).

    mpiexec -n 2 python -m moecomm.loadtest --scenarios zipf,moving-hot,ramp --json load.json --plot load.png
    mpirun -np 2 python -m moecomm.loadtest --scenarios uniform,zipf,moving-hot,mixture,adversarial,ramp,topk,mask
    mpirun -np 4 python -m moecomm.loadtest --scenarios zipf,owners

Scenarios (every rank draws the same popularity, each rank its own tokens):

* ``uniform``, ``zipf``, ``moving-hot`` (Zipf whose hottest expert moves every ``--period`` steps),
  ``mixture`` (``--domains`` Zipf popularity profiles, standing in for languages or tasks, mixed with new
  weights every step; each token tagged with its domain, so that each domain's traffic is reported alone:
  its share, imbalance and hot experts, from the kernels' counts per tag), ``adversarial`` (a synthetic
  linear router and inputs searched so that one expert is in every token's top-k): ``--steps`` steps each.
  Tokens per rank per step: ``--tokens``, or with ``--lengths mixture`` short decode batches (1-8 tokens,
  70 %) and long prompt chunks (half to all of ``--tokens``).
* ``ramp``: Zipf routing at 1, 2, 4, ... ``--tokens`` tokens per rank.
* ``topk``: Zipf routing with top-k 1, 2, 4, 8 (up to ``--topk``).
* ``capacity``: Zipf routing with a capacity of ``--capacity-factors`` times the mean demand per expert
  and ``overflow="drop"``: the share of (token, expert) pairs dropped, and the time.
* ``tp``: EP x TP: the ranks split into tensor-parallel groups of ``--tp-size`` whose all-reduce of a [tokens,
  hidden] activation (NCCL on a stream of its own where each rank has its own GPU, else MPI's Iallreduce)
  runs beside every EP step: EP and all-reduce times alone and together, the EP outputs equal to the steps
  alone, every all-reduce right.
* ``mask``: Zipf steps; the last rank stops answering mid-run; the others name it in a CommTimeout, mask it
  (``AllToAll.mask_ranks``) and keep serving; then it returns and is unmasked.
* ``owners``: expert owners stopped one at a time, every expert with a second replica on another rank: each
  rank in turn stops, the others mask it and run the same steps again: the pairs lost (none where the replicas
  cover), whether each survivor's combined tokens equal its run before the stop, and the step time.
  ``mask`` and ``owners`` leave the communicator serving only through masked AllToAlls: they run last, and
  one of them per invocation.

Per step: dispatch + combine time (host wall time on CPU ranks; on GPUs CUDA events around the eager calls,
each step starting at a device barrier so that the ranks' host skew is not counted; max over ranks), between
them a GEMM per local expert over the rows it received (``--no-gemm`` skips it: CuPy float16 on GPUs, numpy
float32 on CPU ranks) timed alone, the whole layer's time, the (token, expert) pairs per rank (max and mean
over ranks), the imbalance max/mean, and the hot experts (:mod:`moecomm.telemetry`); per scenario p50 and p99
of each time and the GEMM time against the tokens an expert received (what small batches spread over many
experts cost). ``--ep-size`` splits the job into data-parallel replicas of ``ep-size`` ranks,
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
from typing import NamedTuple

import numpy as np

from moecomm._mpi import wait_all
from moecomm.bench import require_matplotlib
from moecomm.comm import TRANSPORTS

ROUTINGS = ("uniform", "zipf", "moving-hot", "mixture", "adversarial")
MASKING = ("mask", "owners")  # each leaves the communicator serving only through masked AllToAlls: last, alone
SCENARIOS = ROUTINGS + ("ramp", "topk", "capacity", "tp") + MASKING
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
    """One routing generator; ``draw(rng, step, m)`` draws a step's expert ids on one rank and, where the routing
    has domains (mixture), each token's domain as its tag (else None)."""

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

    def draw(self, rng, step, m):
        """(ids [m, k] int32, tags [m] int32 or None): a mixture's tokens are tagged with their domain, drawn
        with the step's domain weights (the same on every rank)."""
        E, k, a = self.E, self.k, self.args
        if self.kind == "uniform":
            return _topk(rng, np.zeros((m, E)), k), None
        if self.kind == "zipf":
            return _topk(rng, np.broadcast_to(_zipf(E, a.zipf, a.seed), (m, E)), k), None
        if self.kind == "moving-hot":
            shift = (step // a.period) * max(1, E // 7)
            return _topk(rng, np.broadcast_to(_zipf(E, a.zipf, a.seed, shift), (m, E)), k), None
        if self.kind == "mixture":
            weights = np.random.default_rng([a.seed, step]).dirichlet(np.ones(a.domains))
            domain = rng.choice(a.domains, size=m, p=weights).astype(np.int32)
            return _topk(rng, self.profiles[domain], k), domain
        if self.kind == "adversarial":
            d = self.router.shape[0]
            direction = self.router[:, self.target] / np.linalg.norm(self.router[:, self.target])
            x = rng.standard_normal((m, d)) + self.alpha * direction
            return np.argsort(-(x @ self.router), axis=1)[:, :k].astype(np.int32), None
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
    expert map; ``expert_map`` switches to that map at once; the tokens' tags, a mixture's domains, counted per
    local expert). ``step(ids, tags, m)`` runs dispatch, then (``gemm``) one
    GEMM per local expert over the rows it received ([count, hidden] x [hidden, hidden]: float16 on GPUs, CuPy,
    standing in for a bf16 grouped GEMM at the same rate; float32 numpy on CPU ranks), then combine (the experts'
    outputs are their inputs), and returns a :class:`Step`."""

    def __init__(self, comm, args, k, slots=None, capacity=None, expert_map=None):
        import moecomm
        self.comm, self.k, self.gemm = comm, k, args.gemm
        self.gpu = comm.transport.memory == "device"
        if self.gpu:
            import cupy as xp
            self.xp, dt = xp, np.uint16  # bf16 as raw 16-bit words
        else:
            self.xp, dt = np, moecomm.bfloat16
        M, H = args.tokens, args.hidden
        self.a2a = moecomm.AllToAll(comm, M, args.experts, k, H, None, "bfloat16", "bfloat16", slots_per_rank=slots,
                                    capacity=capacity, overflow="drop", num_tags=args.domains)
        if expert_map is not None:
            self.a2a.set_expert_map(expert_map)
        c = self.a2a.cfg
        xp = self.xp
        self.n, self.ex = xp.zeros(c.num_local_experts, np.int32), xp.zeros(c.expert_x_shape(), dt)
        tokens = np.random.default_rng([args.seed, comm.rank]).standard_normal((M, H)).astype(moecomm.bfloat16)
        self.x, self.out = xp.asarray(tokens.view(dt)), xp.zeros((M, H), dt)
        self.w = xp.ones((M, k), np.float32)
        if self.gemm:  # the experts' matmul operands: activations shaped like expert_x, one weight
            gemm_dt = np.float16 if self.gpu else np.float32
            self.acts = xp.ones(c.expert_x_shape(), gemm_dt)
            self.weight = xp.full((H, H), 1.0 / H, gemm_dt)
        if self.gpu:
            self.events = [xp.cuda.Event() for _ in range(4 + 2 * c.num_local_experts)]
        self.align = True  # GPUs: start each timed step at a device barrier (not while a rank may stall)

    def step(self, ids, tags, m):
        xp, a2a = self.xp, self.a2a
        M = self.x.shape[0]
        idx = np.full((M, self.k), -1, np.int32)
        idx[:m] = ids
        d_idx, bound = xp.asarray(idx), xp.array([m], np.int32)
        d_tags = None
        if tags is not None:  # the tokens' domains (counted per local expert: stats()["by_tag"])
            padded = np.zeros(M, np.int32)
            padded[:m] = tags
            d_tags = xp.asarray(padded)
        ev, marks = self.events if self.gpu else None, {}  # marks: the host's perf_counter at point i

        def mark(i):  # 0, 1: dispatch; 2, 3: combine; 4 + 2 le, 5 + 2 le: local expert le's GEMM
            if self.gpu:
                ev[i].record()
            else:
                marks[i] = time.perf_counter()
        if self.gpu and self.align:  # the ranks' host skew (routing draws, the per-step gather) is not counted
            self.comm.transport.barrier()
        mark(0)
        a2a.dispatch(self.n, self.ex, None, self.x, None, d_idx, bound, weights=self.w, tags=d_tags)
        mark(1)
        if self.gemm:
            counts = self.counts()  # the GEMMs' rows (waits for the dispatch on GPUs)
            for le, rows in enumerate(counts):
                mark(4 + 2 * le)
                if rows:
                    xp.matmul(self.acts[le, :rows], self.weight)
                mark(5 + 2 * le)
        mark(2)
        a2a.combine(self.out, d_idx, None, self.ex, bound)
        mark(3)
        if self.gpu:
            ev[3].synchronize()
            a2a.synchronize()
        if not self.gemm:
            counts = self.counts()

        def span(i, j):
            return xp.cuda.get_elapsed_time(ev[i], ev[j]) / 1e3 if self.gpu else marks[j] - marks[i]
        gemm = [span(4 + 2 * le, 5 + 2 * le) for le in range(len(counts))] if self.gemm else None
        return Step(span(0, 1) + span(2, 3), counts, gemm, span(0, 3))

    def counts(self):
        """The last dispatch's pairs per local expert (numpy; waits for it on GPUs)."""
        return np.asarray(self.n.get() if self.gpu else self.n).copy()

    def output(self, m):
        """The combined tokens of the last step's first ``m`` rows (as float32)."""
        bits = np.asarray(self.out.get() if self.gpu else self.out)[:m].view(np.uint16)
        return (bits.astype(np.uint32) << 16).view(np.float32)

    def close(self):
        self.a2a.destroy()


class Step(NamedTuple):
    """One step of a layer: ``seconds`` of dispatch + combine, ``counts`` [num_local_experts] pairs each local
    expert received, ``gemm`` [num_local_experts] seconds of its GEMM (None without), ``layer`` seconds of the
    whole layer (dispatch, the GEMMs and the wait for the counts they need, combine)."""
    seconds: float
    counts: np.ndarray
    gemm: object
    layer: float


class Steps(NamedTuple):
    """Steps of a layer (:meth:`Layer.step`): ``seconds`` [steps] of dispatch + combine, ``counts`` [steps, L]
    pairs per local expert, ``gemm`` [steps, L] seconds of each local expert's GEMM (None without), ``layer``
    [steps] seconds of the whole layer. Gathered (:func:`gather_steps`): the slowest rank's times, every rank's
    experts side by side ([steps, E])."""
    seconds: np.ndarray
    counts: np.ndarray
    gemm: object
    layer: np.ndarray


def run_steps(comm, layer, routing, steps, args, first_step=0, replan=0, outputs=None, beside=None):
    """``steps`` steps of ``routing``: this rank's :class:`Steps`. With ``replan`` (and a layer with expert
    slots), every ``replan`` steps the replicas are planned again from the load of the last ``replan`` steps
    (moecomm.balance.plan, kept close to the map in use) and switched. ``outputs``: a list that gets each
    step's combined tokens (Layer.output). ``beside``: other traffic (:class:`TensorParallel`) started before
    each step and finished after it."""
    from moecomm import balance
    done = []
    for s in range(first_step, first_step + steps):
        if replan and s > first_step and (s - first_step) % replan == 0:
            recent = np.array([d.counts for d in done[-replan:]])
            window = np.concatenate(comm.allgather(recent, "loadtest replan"), axis=1)
            emap = layer.a2a.expert_map
            held = emap.slots.ravel()
            load = np.bincount(held[held >= 0], weights=window.sum(axis=0)[held >= 0], minlength=emap.num_experts)
            layer.a2a.set_expert_map(balance.plan(load, emap.num_ranks, emap.slots_per_rank, previous=emap).map)
        rng = np.random.default_rng([args.seed, comm.rank, s])
        m = tokens_per_step(rng, args)
        if beside is not None:
            beside.start()
        done.append(layer.step(*routing.draw(rng, s, m), m))
        if beside is not None:
            beside.finish()
        if outputs is not None:
            outputs.append(layer.output(m))
        args.progress(s - first_step + 1, steps)
    gemm = np.array([d.gemm for d in done]) if layer.gemm else None
    return Steps(np.array([d.seconds for d in done]), np.array([d.counts for d in done]), gemm,
                 np.array([d.layer for d in done]))


class Progress:
    """A progress bar on rank 0's stderr (``on``: ``--progress``, or stderr is a terminal): :meth:`start` names
    the scenario, calling it with (steps done, steps) redraws the bar, at most ten times a second."""

    def __init__(self, on):
        self.on, self.label, self.drawn = on, "", 0.0

    def start(self, label):
        self.label, self.drawn = label, 0.0

    def __call__(self, done, total):
        now = time.monotonic()
        if not self.on or (done < total and now - self.drawn < 0.1):
            return
        self.drawn, width = now, 30
        bar = "#" * (width * done // max(total, 1))
        sys.stderr.write(f"\r{self.label:<14} [{bar:<{width}}] {done}/{total}" + ("\n" if done == total else ""))
        sys.stderr.flush()


def gather_steps(allgather, steps):
    """Every rank's :class:`Steps` through ``allgather`` (the communicator's, or plain MPI's once it serves only
    through masked AllToAlls): the slowest rank's times per step, every rank's experts side by side."""
    everyone = allgather(steps)
    return Steps(np.max([e.seconds for e in everyone], axis=0), np.concatenate([e.counts for e in everyone], axis=1),
                 None if steps.gemm is None else np.concatenate([e.gemm for e in everyone], axis=1),
                 np.max([e.layer for e in everyone], axis=0))


def summarize_steps(name, steps, num_ranks):
    """A scenario's record: dispatch + combine and layer time (p50, p99), load per rank, imbalance, hot experts,
    the experts' GEMM time against the tokens each received (:func:`gemm_by_tokens`), and the per-step series."""
    from moecomm import telemetry
    counts = steps.counts
    m = telemetry.summarize(counts, num_ranks)
    rank = counts.reshape(len(counts), num_ranks, -1).sum(axis=2)
    mean = counts.mean(axis=1)  # the hottest expert against the mean: what its GEMM waits for, at any EP size
    expert = np.where(mean > 0, counts.max(axis=1) / np.where(mean > 0, mean, 1), 1.0)
    out = {"scenario": name, "num_ranks": num_ranks, "steps": len(steps.seconds), "time_us": _p50_p99(steps.seconds),
           "layer_time_us": _p50_p99(steps.layer),
           "rank_tokens_max": float(rank.max(axis=1).mean()), "rank_tokens_mean": float(rank.mean()),
           "imbalance": {k: m["imbalance"][k] for k in ("mean", "p95", "max")},
           "expert_imbalance": {"mean": float(expert.mean()), "max": float(expert.max())},
           "hot_experts": m["hot"]["experts"][:8], "per_step": {
               "time_us": (steps.seconds * 1e6).round(2).tolist(), "layer_us": (steps.layer * 1e6).round(2).tolist(),
               "imbalance": m["imbalance"]["per_step"], "rank_tokens_max": rank.max(axis=1).tolist(),
               "expert_imbalance": expert.round(3).tolist(), "expert_pairs_max": counts.max(axis=1).tolist()}}
    if steps.gemm is not None:
        out["gemm"] = gemm_by_tokens(counts, steps.gemm, num_ranks)
    return out


def _p50_p99(seconds):
    return {"p50": float(np.median(seconds) * 1e6), "p99": float(np.percentile(seconds, 99) * 1e6)}


def gemm_by_tokens(counts, gemm, num_ranks):
    """The local experts' GEMM time against the tokens each received, over every (step, expert): per bin of
    tokens (0, 1, 2-3, 4-7, ...) the experts-steps in it, the median and p99 microseconds of a GEMM and the
    median per token; and per step the slowest rank's GEMMs together (p50, p99 microseconds): what small
    batches spread over many experts cost."""
    c, g = np.asarray(counts).ravel(), np.asarray(gemm).ravel() * 1e6
    edges = [0, 1] + [2 ** i for i in range(1, int(np.log2(max(2, c.max()))) + 2)]
    bins = []
    for lo, hi in zip(edges, edges[1:]):
        sel = (c >= lo) & (c < hi)
        if sel.any():
            per_token = g[sel] / np.maximum(c[sel], 1)
            bins.append({"tokens": [lo, hi - 1], "expert_steps": int(sel.sum()), "median_us": float(np.median(g[sel])),
                         "p99_us": float(np.percentile(g[sel], 99)),
                         "median_us_per_token": float(np.median(per_token))})
    steps = len(counts)
    per_rank = np.asarray(gemm).reshape(steps, num_ranks, -1).sum(axis=2).max(axis=1)
    return {"by_tokens": bins, "rank_total_us": _p50_p99(per_rank)}


def by_domain(allgather, layer, steps):
    """Each domain's traffic alone over the last ``steps`` calls of ``layer`` (its tokens' tags, counted per
    local expert by the kernels: stats()["by_tag"], every rank's gathered): its share of the pairs, its
    imbalance and its hot experts, which a global histogram hides."""
    from moecomm import telemetry
    snaps = allgather(layer.a2a.stats())
    n = min(steps, min(len(s["window"]) for s in snaps))
    m = telemetry.from_stats([dict(s, window=s["window"][-n:], by_tag=s["by_tag"][-n:]) for s in snaps])
    return [{"domain": t["tag"], "share": t["share_of_tagged"], "imbalance": {k: t["imbalance"][k] for k in
                                                                              ("mean", "max")},
             "hot_experts": t["hot"]["experts"][:8], "top_expert_share": max(t["expert"]["share"])}
            for t in m["by_tag"]]


def scenario_mask(comm, layer, routing, args):
    """Zipf steps; the last rank stalls; the others time out naming it, mask it, serve, then take it back."""
    import moecomm
    world, last, third = comm.bootstrap.mpi, comm.world_size - 1, max(1, args.steps // 3)
    record = {"scenario": "mask", "ranks": comm.world_size}
    if comm.world_size < 2:
        return dict(record, skipped="needs at least 2 ranks (one stalls, the others mask it)")
    layer.align = False  # a device barrier would wait for the stalled rank too
    before = run_steps(comm, layer, routing, third, args)
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
        masked = run_steps(comm, layer, routing, third, args, third + 1)
        record["masked_time_us_p50"] = float(np.median(masked.seconds) * 1e6)
        record["masked_pairs"] = layer.a2a.stats()["MASKED_PAIRS"]
        if comm.rank == 0:
            world.send(None, dest=last, tag=TAG_RETURN)
    layer.a2a.mask_ranks([])
    after = run_steps(comm, layer, routing, third, args, 2 * third + 1)
    record.update(before_time_us_p50=float(np.median(before.seconds) * 1e6),
                  after_time_us_p50=float(np.median(after.seconds) * 1e6))
    everyone = world.allgather(record)  # plain MPI: the communicator serves only through the masked AllToAll now
    return dict(everyone[0], survivors=[dict(r, rank=q) for q, r in enumerate(everyone) if "detected" in r])


class TensorParallel:
    """A tensor-parallel group's all-reduce of a [tokens, hidden] float32 activation, run beside EP traffic: NCCL
    on a stream of its own where every rank of the group has a GPU of its own, else MPI's Iallreduce of a host
    buffer (CPU ranks, or ranks that share a GPU: NCCL refuses two ranks of one communicator on one GPU).
    :meth:`start` issues it, :meth:`finish` waits for it and keeps its seconds in ``times`` and whether its
    result was right in ``right`` (every rank gives its TP rank + 1 everywhere: the sum is known)."""

    def __init__(self, world, tp_size, args, device):
        self.group = world.Split(world.Get_rank() // tp_size, world.Get_rank())
        size, rank, n = self.group.Get_size(), self.group.Get_rank(), args.tokens * args.hidden
        self.want, self.times, self.right = size * (size + 1) / 2, [], True
        self.kind = "host"
        if device is not None:
            import cupy
            bus = cupy.cuda.Device(device).pci_bus_id
            if len(set(self.group.allgather(bus))) == size:
                from cupy.cuda import nccl
                uid = self.group.bcast(nccl.get_unique_id() if rank == 0 else None)
                self.kind, self.cp, self.nccl = "nccl", cupy, nccl
                self.comm = nccl.NcclCommunicator(size, uid, rank)
                self.stream = cupy.cuda.Stream(non_blocking=True)
                self.events = (cupy.cuda.Event(), cupy.cuda.Event())
                self.send, self.recv = cupy.full(n, rank + 1, np.float32), cupy.zeros(n, np.float32)
        if self.kind == "host":
            self.send, self.recv = np.full(n, rank + 1, np.float32), np.zeros(n, np.float32)

    def start(self):
        if self.kind == "nccl":
            self.events[0].record(self.stream)
            self.comm.allReduce(self.send.data.ptr, self.recv.data.ptr, self.send.size, self.nccl.NCCL_FLOAT32,
                                self.nccl.NCCL_SUM, self.stream.ptr)
            self.events[1].record(self.stream)
        else:
            from mpi4py import MPI
            self.recv[:] = 0
            self.t0, self.request = time.perf_counter(), self.group.Iallreduce(self.send, self.recv, op=MPI.SUM)

    def finish(self):
        if self.kind == "nccl":
            self.events[1].synchronize()
            self.times.append(self.cp.cuda.get_elapsed_time(*self.events) / 1e3)
            self.right = self.right and bool((self.recv == self.want).all())
        else:
            self.request.Wait()
            self.times.append(time.perf_counter() - self.t0)
            self.right = self.right and bool((self.recv == self.want).all())

    def alone(self, steps):
        """``steps`` all-reduces one after another, nothing beside them: their seconds."""
        first = len(self.times)
        for _ in range(steps):
            self.start()
            self.finish()
        return np.array(self.times[first:])


def scenario_tp(comm, world, layer, routing, args, device):
    """EP x TP: the job's ranks (``world``, an mpi4py communicator) split into tensor-parallel groups of
    ``--tp-size`` consecutive ranks whose all-reduce (:class:`TensorParallel`) runs beside every EP step. The EP
    steps alone, the all-reduces alone, then both together on the same steps: their times, whether the EP
    outputs equal those of the steps alone and whether every all-reduce was right."""
    if world.Get_size() % args.tp_size:
        return {"scenario": "tp", "skipped": f"--tp-size {args.tp_size} does not divide the {world.Get_size()} ranks"}
    tp = TensorParallel(world, args.tp_size, args, device)
    alone_out, both_out = [], []
    ep_alone = run_steps(comm, layer, routing, args.steps, args, outputs=alone_out)
    tp_alone = tp.alone(args.steps)
    first = len(tp.times)
    ep_both = run_steps(comm, layer, routing, args.steps, args, outputs=both_out, beside=tp)
    tp_both = np.array(tp.times[first:])
    mine = dict(equal=all(np.array_equal(a, b) for a, b in zip(alone_out, both_out)), right=tp.right)
    everyone = world.allgather(mine)
    slowest = lambda t: np.max(world.allgather(t), axis=0)  # noqa: E731 - the slowest rank per step
    return {"scenario": "tp", "tp_size": args.tp_size, "collective": tp.kind,
            "ep_alone_us": _p50_p99(slowest(ep_alone.seconds)), "tp_alone_us": _p50_p99(slowest(tp_alone)),
            "ep_beside_tp_us": _p50_p99(slowest(ep_both.seconds)), "tp_beside_ep_us": _p50_p99(slowest(tp_both)),
            "outputs_equal": all(e["equal"] for e in everyone), "all_reduce_right": all(e["right"] for e in everyone)}


def scenario_owners(comm, args):
    """Expert owners stopped one at a time, with a second replica of every expert (rank q's spare slots hold rank
    q+1's experts): each rank in turn stops (it waits for a plain MPI message), the others mask it and run the
    same steps again (each rank's tokens and ids drawn per step), then it returns and every rank unmasks it.
    Per stop: the pairs not sent (none: the replica rule passes over a masked rank), whether every survivor's
    combined tokens equal its run of the same steps before the stop, and the step time before and during."""
    from moecomm.balance import ExpertMap
    W, L, world = comm.world_size, args.experts // comm.world_size, comm.bootstrap.mpi
    record = {"scenario": "owners", "ranks": W}
    if W < 2:
        return dict(record, skipped="needs at least 2 ranks (one stops, the others serve its experts)")
    slots = np.array([np.concatenate([np.arange(q * L, q * L + L), np.arange(L) + (q + 1) % W * L])
                      for q in range(W)])
    lay = Layer(comm, args, args.topk, slots=2 * L, expert_map=ExpertMap(slots, args.experts, generation=1))
    lay.align = False  # a device barrier would wait for the stopped rank too
    routing, n = Routing("zipf", args.experts, args.topk, args), max(1, args.steps // W)
    stops = []
    for q in range(W):
        first = q * n
        want = []
        before = run_steps(comm, lay, routing, n, args, first, outputs=want)
        if comm.rank == q:  # stopped until a survivor calls it back
            world.recv(source=1 if q == 0 else 0, tag=TAG_RETURN)
            mine = None
        else:
            lay.a2a.mask_ranks([q])
            lost = lay.a2a.stats()["MASKED_PAIRS"]
            got = []
            during = run_steps(comm, lay, routing, n, args, first, outputs=got)
            mine = dict(pairs_lost=lay.a2a.stats()["MASKED_PAIRS"] - lost,
                        outputs_equal=all(np.array_equal(a, b) for a, b in zip(got, want)),
                        time_us_p50=float(np.median(during.seconds) * 1e6))
            if comm.rank == (1 if q == 0 else 0):
                world.send(None, dest=q, tag=TAG_RETURN)
        lay.a2a.mask_ranks([])  # it is back: every rank takes part
        survivors = [x for x in world.allgather(mine) if x is not None]  # plain MPI: the communicator is broken
        stops.append({"stopped": q, "pairs_lost": sum(x["pairs_lost"] for x in survivors),
                      "outputs_equal": all(x["outputs_equal"] for x in survivors),
                      "time_us_p50_before": float(np.median(np.max(world.allgather(before.seconds), axis=0)) * 1e6),
                      "time_us_p50_stopped": max(x["time_us_p50"] for x in survivors)})
    lay.close()
    return dict(record, slots_per_rank=2 * L, steps_per_stop=n, stops=stops)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m moecomm.loadtest", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default="uniform,zipf,moving-hot,ramp",
                   help=f"comma list of {', '.join(SCENARIOS)} (default: uniform,zipf,moving-hot,ramp)")
    p.add_argument("--steps", type=int, default=60, help="steps per scenario (default 60)")
    p.add_argument("--tokens", type=int, default=128, help="most tokens per rank per step (default 128)")
    p.add_argument("--lengths", choices=["fixed", "mixture"], default="fixed",
                   help="tokens per rank per step: always --tokens, or drawn from a mixture of lengths")
    p.add_argument("--experts", type=int, default=64, help="experts in all (default 64)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (default 8)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
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
    p.add_argument("--tp-size", type=int, default=2, help="ranks per tensor-parallel group (tp scenario)")
    p.add_argument("--progress", action="store_true",
                   help="a progress bar on rank 0's stderr (default: only where it is a terminal; launchers pipe it)")
    p.add_argument("--no-gemm", dest="gemm", action="store_false",
                   help="skip the GEMM per local expert between dispatch and combine")
    p.add_argument("--transport", default="auto", choices=TRANSPORTS,
                   help="moecomm.init(transport=...) (default auto)")
    p.add_argument("--timeout", type=float, default=None, help="seconds any wait may last (mask: time to detect)")
    p.add_argument("--seed", type=int, default=0, help="routing seed (default 0)")
    p.add_argument("--json", default="loadtest.json", help="output JSON (rank 0; default loadtest.json)")
    p.add_argument("--plot", metavar="PNG", help="also draw the scenarios here (rank 0; needs matplotlib: pip "
                   "install 'moecomm[plot]')")
    args = p.parse_args(argv)
    require_matplotlib(p, args.plot)
    names = [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown or not names:
        p.error(f"unknown scenario(s) {unknown}; expected some of {','.join(SCENARIOS)}")
    if len([s for s in names if s in MASKING]) > 1:
        p.error("mask and owners each leave the communicator serving only through masked AllToAlls: run them in "
                "separate invocations")
    names.sort(key=lambda s: s in MASKING)  # last: it leaves the communicator serving through masked AllToAlls
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

    args.progress = Progress(first and (args.progress or sys.stderr.isatty()))
    for name in names:
        t0 = time.time()
        args.progress.start(name)
        if name in ROUTINGS:
            routing = Routing(name, args.experts, args.topk, args)
            steps = gather_steps(comm.allgather, run_steps(comm, layer(args.topk), routing, args.steps, args))
            r = summarize_steps(name, steps, comm.world_size)
            if name == "adversarial":
                r["target"] = {"expert": routing.target, "push": routing.alpha, "hit_rate": routing.hit}
            if name == "mixture":  # each domain alone, from the tags the kernels counted
                r["domains"] = by_domain(comm.allgather, layer(args.topk), args.steps)
            if slots:  # the same steps with planned replicas, re-planned every --replan steps
                lay = layer(args.topk, slots)
                emap = lay.a2a.expert_map
                if emap.generation:  # start from the static map again (a previous scenario planned this one)
                    lay.a2a.set_expert_map(balance.ExpertMap.static(args.experts, comm.world_size, slots,
                                                                    generation=emap.generation + 1))
                before = lay.a2a.expert_map.generation
                steps = gather_steps(comm.allgather,
                                     run_steps(comm, lay, routing, args.steps, args, replan=args.replan))
                r["replicas"] = dict(summarize_steps(f"{name} + replicas", steps, comm.world_size),
                                     slots_per_rank=slots, replan=args.replan,
                                     switches=lay.a2a.expert_map.generation - before)
        elif name == "ramp":
            routing, r = Routing("zipf", args.experts, args.topk, args), {"scenario": "ramp", "points": []}
            lay, saved, size = layer(args.topk), args.tokens, 1  # the layer keeps the full capacity
            while size <= saved:
                args.tokens = size  # every step at this size
                steps = gather_steps(comm.allgather, run_steps(comm, lay, routing, args.steps, args))
                r["points"].append(dict(summarize_steps(f"ramp {size}", steps, comm.world_size), tokens=size))
                size *= 2
            args.tokens = saved
        elif name == "topk":
            r = {"scenario": "topk", "points": []}
            for k in (k for k in (1, 2, 4, 8, 16) if k <= args.topk):
                routing = Routing("zipf", args.experts, k, args)
                steps = gather_steps(comm.allgather, run_steps(comm, layer(k), routing, args.steps, args))
                r["points"].append(dict(summarize_steps(f"topk {k}", steps, comm.world_size), topk=k))
        elif name == "capacity":
            r, routing = {"scenario": "capacity", "points": []}, Routing("zipf", args.experts, args.topk, args)
            mean = args.tokens * comm.world_size * args.topk / args.experts  # pairs per expert per step, at most
            for factor in (float(f) for f in args.capacity_factors.split(",")):
                cap = max(1, min(args.tokens * comm.world_size, int(np.ceil(factor * mean))))
                lay = layer(args.topk, capacity=cap)
                before = lay.a2a.stats()["DROPPED_PAIRS"]
                steps = gather_steps(comm.allgather, run_steps(comm, lay, routing, args.steps, args))
                dropped = sum(comm.allgather(lay.a2a.stats()["DROPPED_PAIRS"] - before, "loadtest"))
                point = dict(summarize_steps(f"capacity {factor:g}x", steps, comm.world_size), factor=factor,
                             capacity=cap, dropped_pairs=dropped)
                point["dropped_share"] = dropped / max(1, dropped + int(steps.counts.sum()))
                r["points"].append(point)
        elif name == "owners":
            r = scenario_owners(comm, args)
        elif name == "tp":
            r = scenario_tp(comm, world, layer(args.topk), Routing("zipf", args.experts, args.topk, args), args,
                            comm.device if comm.device >= 0 else None)
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
               "moecomm": getattr(moecomm, "__version__", "0.1.0"),
               "args": {k: v for k, v in vars(args).items() if k != "progress"}, "results": results}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        if args.plot:
            plot(results, args.plot)
        print(f"wrote {args.json}" + (f" and {args.plot}" if args.plot else ""))
    if comm.broken is None:  # the masking scenarios leave it serving only through their AllToAlls
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
    if r["scenario"] == "tp":
        return (f"{'tp':<12} TP{r['tp_size']} all-reduce ({r['collective']}) beside EP: EP p50 "
                f"{r['ep_alone_us']['p50']:.0f} -> {r['ep_beside_tp_us']['p50']:.0f} us, all-reduce p50 "
                f"{r['tp_alone_us']['p50']:.0f} -> {r['tp_beside_ep_us']['p50']:.0f} us; outputs "
                f"{'equal' if r['outputs_equal'] else 'DIFFER'}, all-reduce "
                f"{'right' if r['all_reduce_right'] else 'WRONG'}")
    if r["scenario"] == "owners":
        return f"{'owners':<12} " + "  ".join(
            f"rank {x['stopped']} stopped: {x['pairs_lost']} pairs lost, outputs "
            f"{'equal' if x['outputs_equal'] else 'DIFFER'}, p50 {x['time_us_p50_before']:.0f} -> "
            f"{x['time_us_p50_stopped']:.0f} us" for x in r["stops"])
    if r["scenario"] == "mask":
        return (f"{'mask':<12} {r.get('detected', 'stalled rank')}; p50 {r['before_time_us_p50']:.0f} us before, "
                f"{r.get('masked_time_us_p50', float('nan')):.0f} masked, {r['after_time_us_p50']:.0f} after")
    target = (f"  target expert {r['target']['expert']} in the top-k of {r['target']['hit_rate']:.0%} of searched "
              f"inputs") if "target" in r else ""
    gemm = (f"  expert GEMMs p50 {r['gemm']['rank_total_us']['p50']:.0f} us, layer p50 "
            f"{r['layer_time_us']['p50']:.0f} us") if "gemm" in r else ""
    domains = f"\n{'  domains':<12} " + "  ".join(
        f"{d['domain']}: {d['share']:.0%} of pairs, imbalance {d['imbalance']['mean']:.2f}, top expert "
        f"{d['top_expert_share']:.0%}" for d in r["domains"]) if "domains" in r else ""
    return (f"{r['scenario']:<12} p50 {r['time_us']['p50']:.0f} us  p99 {r['time_us']['p99']:.0f} us  "
            f"rank tokens max {r['rank_tokens_max']:.0f} / mean {r['rank_tokens_mean']:.0f}  "
            f"imbalance mean {r['imbalance']['mean']:.2f} max {r['imbalance']['max']:.2f}  expert imbalance mean "
            f"{r['expert_imbalance']['mean']:.2f} max {r['expert_imbalance']['max']:.2f}  hot {r['hot_experts']}"
            + gemm + target + domains)


def plot(results, path):
    """Per routing scenario (and its replicas run, dashed): imbalance and step time over the steps, the
    step-time CDF, the busiest rank's pairs per step and an expert's GEMM time against the tokens it received;
    time against tokens for ramp when it ran. With one rank per EP group the load panels are the experts' (the
    hottest expert against the mean, its pairs), a rank's being the whole load."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = [(x, "--" if x is not r else "-") for r in results if "per_step" in r for x in (r, r.get("replicas")) if x]
    ramp = next((r for r in results if r["scenario"] == "ramp"), None)
    n = 6
    unit = "rank" if runs and runs[0][0]["num_ranks"] > 1 else "expert"
    load, busiest = ("imbalance", "rank_tokens_max") if unit == "rank" else ("expert_imbalance", "expert_pairs_max")
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    axes = axes.ravel()
    for x, ls in runs:
        ps, name = x["per_step"], x["scenario"]
        t = np.sort(ps["time_us"])
        axes[0].plot(ps[load], label=name, ls=ls)
        axes[1].plot(ps["time_us"], label=name, ls=ls)
        axes[2].plot(t, np.arange(1, t.size + 1) / t.size, label=name, ls=ls)
        axes[3].plot(ps[busiest], label=name, ls=ls)
        if "gemm" in x:
            bins = x["gemm"]["by_tokens"]
            axes[5].plot([max(b["tokens"][0], 0.5) for b in bins], [b["median_us"] for b in bins], "o", label=name,
                         ls=ls)
    axes[0].set(xlabel="step", ylabel=f"max / mean {unit} load", title=f"{unit} imbalance per step")
    axes[1].set(xlabel="step", ylabel="dispatch + combine (us, max over ranks)", title="step time", yscale="log")
    axes[2].set(xlabel="dispatch + combine (us)", ylabel="fraction of steps", title="step time CDF", xscale="log")
    axes[3].set(xlabel="step", ylabel="(token, expert) pairs", title=f"busiest {unit}'s pairs per step")
    if ramp:
        t = [pt["tokens"] for pt in ramp["points"]]
        axes[4].plot(t, [pt["time_us"]["p50"] for pt in ramp["points"]], "o-", label="p50")
        axes[4].plot(t, [pt["time_us"]["p99"] for pt in ramp["points"]], "s--", label="p99")
        axes[4].set(xlabel="tokens per rank", ylabel="us", title="ramp (zipf)", xscale="log")
    axes[5].set(xlabel="tokens an expert received (bin start; 0 at 0.5)", ylabel="GEMM us, median",
                title="GEMM per local expert", xscale="log", yscale="log")
    for i, ax in enumerate(axes):
        if i >= n or (i == 4 and not ramp):
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
