"""``mpirun -np N python -m moecomm.bench``: time dispatch and combine against NCCL all-to-all.

Defaults run the two headline configurations (DeepSeek-R1 decode and prefill); ``--configs`` adds
``v2-lite`` and ``sweep`` (R1 shapes, 1 ... 4096 tokens per rank). For each configuration:

* correctness first: the dispatch counts (and, for small configurations, every expert's tokens) are checked
  against :mod:`moecomm.reference` on fresh random routing;
* eager launches, per phase (dispatch send, dispatch recv, combine send, combine recv) with CUDA events;
* CUDA graphs replayed: dispatch() and combine() as users call them, both halves each (one launch per phase
  where its grid is resident: graph "total", the headline figure), and the four half calls in sequence
  (graph "split_total": send and receive halves split, as for overlapping other work);
* each phase captured in its own graph and replayed alone, after a barrier that guarantees the peers'
  earlier phases are complete: the phase's own device time, without waiting for peers;
* host time per eager call (dispatch with both halves; combine with both halves) for CuPy arrays,
  PyTorch tensors (when torch is installed) and raw DeviceBuffers, measured while the device is kept busy
  by a delay kernel so that the launch queue never blocks the host; and the eager layer (dispatch +
  combine, host in the loop) timed with events;
* the NCCL baseline through CuPy's NCCL binding: the standard all-to-all of one row per (token, expert)
  (fp8 + scales out, bf16 back), with exact per-rank sizes and padded to the worst case;
* medians and p99 over ``--iters`` iterations after ``--warmup``, each iteration started by an on-stream
  barrier, the maximum over ranks taken per iteration. Graph replays and NCCL calls are preceded by a
  device-side delay (``--delay-us``) so that they are queued before their start event fires: the host's
  launch latency is not in those timings (eager timings include everything the host does).

Router weights go with dispatch (combine sums a token's local experts on the expert side). Output: a table,
a JSON file (configuration, machine, versions, git commit, every figure) and, with matplotlib, a PNG plot
of latency against tokens per rank.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time
from contextlib import nullcontext

import numpy as np

import moecomm
from moecomm import _abi, _cuda, _jit, reference
from moecomm.comm import gpu_count
from moecomm.transport.gpu_alltoall import record_bytes

CONFIGS = {  # name: (tokens per rank, experts, top-k, hidden, scales per token)
    "r1-decode": (128, 256, 8, 7168, 56),
    "r1-prefill": (4096, 256, 8, 7168, 56),
    "v2-lite": (128, 64, 6, 2048, 16),
}
SWEEP_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
PHASES = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")


def routing(rng, m, k, experts, kind):
    if kind == "uniform":
        return np.argsort(rng.random((m, experts)), axis=1)[:, :k].astype(np.int32)
    if kind == "zipf":  # expert popularity ~ 1/rank, random order of experts
        p = 1.0 / np.arange(1, experts + 1)
        p = rng.permutation(p / p.sum())
        return np.stack([rng.choice(experts, k, replace=False, p=p) for _ in range(m)]).astype(np.int32)
    if kind == "hot":  # expert 0 in every token's top-k
        rest = np.argsort(rng.random((m, experts - 1)), axis=1)[:, :k - 1] + 1
        return np.concatenate([np.zeros((m, 1), np.int64), rest], axis=1).astype(np.int32)
    raise ValueError(kind)


def stats(samples_us):
    a = np.asarray(samples_us)
    return {"median_us": float(np.median(a)), "p99_us": float(np.percentile(a, 99)),
            "mean_us": float(a.mean()), "n": int(a.size)}


def delay_kernel(transport):
    """(its moecomm._abi.Delay parameters, its launch) of the device-delay kernel, from the benchmark's own
    module (never part of a transport's), loaded in ``transport``'s context."""
    args, kernel = _abi.Delay(), _abi.KERNELS["moecomm_delay"]
    with transport.context:
        module = _cuda.Module(_jit.build(transport.build.arch, "bench").cubin)
        return args, _cuda.Launch(module.function(kernel), kernel, 1, args)


class Bench:
    def __init__(self, comm, args):
        import cupy
        self.comm, self.args, self.cp = comm, args, cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.nccl = self._nccl()
        self._delay_args, self._delay_launch = delay_kernel(comm.transport)

    def delay(self, us):
        """A device-side delay of ``us`` microseconds on the bench stream."""
        self._delay_args.ns = int(us * 1e3)
        self._delay_launch(self.stream.ptr)

    def _nccl(self):
        try:
            from cupy.cuda import nccl
        except ImportError:
            return None
        if not getattr(nccl, "available", True):
            return None
        uid = nccl.get_unique_id() if self.comm.rank == 0 else None
        uid = self.comm.mpi.bcast(uid, root=0)
        return nccl, nccl.NcclCommunicator(self.comm.world_size, uid, self.comm.rank)

    def barrier(self):
        self.comm.transport.barrier(self.stream.ptr)

    def start(self, event):
        """Barrier, device delay, then ``event``: what follows is queued before the event fires."""
        self.barrier()
        self.delay(self.args.delay_us)
        event.record(self.stream)

    def time_graphs(self, graphs, timed):
        """Replay ``graphs`` in order per iteration; time graphs[timed] (after start()). Max over ranks."""
        ev = [self.cp.cuda.Event() for _ in range(3)]
        t = []
        for it in range(self.args.warmup + self.args.iters):
            for i, g in enumerate(graphs):
                if i == timed:
                    self.start(ev[0])
                    g.launch(self.stream)
                    ev[1].record(self.stream)
                else:
                    g.launch(self.stream)
            ev[2].record(self.stream)
            ev[2].synchronize()
            if it >= self.args.warmup:
                t.append([self.cp.cuda.get_elapsed_time(ev[0], ev[1]) * 1e3])
        return self.max_over_ranks(t)[:, 0]

    def capture(self, fn):
        s = self.stream
        with s:
            s.begin_capture(self.cp.cuda.runtime.streamCaptureModeRelaxed)
            fn()
            return s.end_capture()

    def launch_floor(self):
        """One graph of one empty kernel, timed like the phases: the fixed cost of any graph replay."""
        g = self.capture(lambda: self.delay(0))
        return stats(self.time_graphs([g], 0))

    def max_over_ranks(self, per_iter):
        """per_iter: [iters, n] float array; returns the elementwise max over ranks."""
        return np.max(np.stack(self.comm.allgather(np.asarray(per_iter))), axis=0)

    def run(self, name, tokens, experts, k, hidden, scales):
        """Every figure of one configuration (CuPy's current stream is the bench stream throughout)."""
        with self.stream:
            return self._run(name, tokens, experts, k, hidden, scales)

    def _run(self, name, tokens, experts, k, hidden, scales):
        cp, comm, s = self.cp, self.comm, self.stream
        W, rank = comm.world_size, comm.rank
        L = experts // W
        wire = self.args.dispatch_wire  # bf16 tokens quantised by dispatch (scales made there), else FP8 given
        a2a = moecomm.AllToAll(comm, tokens, experts, k, hidden, None if wire else scales,
                               "bfloat16" if wire else "float8_e4m3fn", "bfloat16",
                               telemetry_window=self.args.telemetry_window, timing=self.args.timing,
                               layout=self.args.layout, combine_wire=self.args.combine_wire,
                               num_tags=self.args.tags, score_gap=self.args.score_gap, dispatch_wire=wire)
        scales = a2a.cfg.hidden_dim_scale
        rows = a2a.cfg.expert_x_shape()[:-1]  # (L, slots) padded, (rows,) packed
        rng = np.random.default_rng([self.args.seed, tokens])
        idx = [routing(rng, tokens, k, experts, self.args.routing) for _ in range(W)]
        x = [rng.integers(0, 255, (tokens, hidden), np.uint8) & 0x77 for _ in range(W)]  # finite fp8 bytes
        xs = [rng.random((tokens, scales), np.float32) for _ in range(W)]
        if wire:  # bf16 tokens (as uint16) across a few binades; dispatch makes the e4m3 values and scales
            x = [rng.standard_normal((tokens, hidden)).astype(moecomm.bfloat16).view(np.uint16) for _ in range(W)]
            xs = [reference.quantize_tokens(xi.view(moecomm.bfloat16), wire, np.float32)[1] for xi in x]
        w = [rng.random((tokens, k), np.float32) for _ in range(W)]
        d = dict(x=cp.asarray(x[rank]), xs=None if wire else cp.asarray(xs[rank]), idx=cp.asarray(idx[rank]),
                 w=cp.asarray(w[rank]), m=cp.asarray(np.array([tokens], np.int32)),
                 n=cp.zeros(L, np.int32), ex=cp.zeros(rows + (hidden,), np.uint8),
                 es=cp.zeros(rows + (scales,), np.float32), y=cp.empty(rows + (hidden,), np.uint16),
                 out=cp.zeros((tokens, hidden), np.uint16))
        if self.args.layout == "packed":
            d["off"] = cp.zeros(L + 1, np.int32)
        # with --tags, each token's tag (tenant, say): counted per local expert by the kernels
        d["tags"] = cp.asarray(rng.integers(0, self.args.tags, tokens).astype(np.int32)) if self.args.tags else None
        d["y"][...] = cp.arange(hidden, dtype=np.uint16) % 251 + 0x3C00  # finite bf16 (1..2)

        def phase(i, dispatch):
            send, recv = i % 2 == 0, i % 2 == 1
            if dispatch:
                a2a.dispatch(d["n"], d["ex"], d["es"], d["x"], d["xs"], d["idx"], d["m"], do_send=send,
                             do_recv=recv, weights=d["w"], stream=s, out_expert_offsets=d.get("off"), tags=d["tags"])
            else:
                a2a.combine(d["out"], d["idx"], None, d["y"], d["m"], do_send=send, do_recv=recv, stream=s)

        def calls():  # dispatch() and combine() as users call them: both halves each
            a2a.dispatch(d["n"], d["ex"], d["es"], d["x"], d["xs"], d["idx"], d["m"], weights=d["w"], stream=s,
                         out_expert_offsets=d.get("off"), tags=d["tags"])
            a2a.combine(d["out"], d["idx"], None, d["y"], d["m"], stream=s)

        # correctness on this routing before timing
        for i in range(4):
            phase(i, i < 2)
        a2a.synchronize(s)
        sent = ([reference.quantize_tokens(xi.view(moecomm.bfloat16), wire, np.float32)[0] for xi in x] if wire else
                [xi.view(moecomm.float8_e4m3fn) for xi in x])
        ref = reference.dispatch(sent, xs, idx, experts, W, tokens)[rank]
        counts = d["n"].get()
        ok = bool(np.array_equal(counts, ref["expert_num_tokens"]))
        if ok and tokens * k * W <= 4096:
            ex, es = d["ex"].get(), d["es"].get()
            if "off" in d:  # packed: expert e's rows start at its offset
                off = d["off"].get()
                ex, es = [ex[o:] for o in off[:-1]], [es[o:] for o in off[:-1]]
            ok = all(np.array_equal(reference.canonical_rows(int(c), ex[e], es[e]),
                                    reference.canonical_rows(int(c), ref["expert_x"][e].view(np.uint8),
                                                             ref["expert_x_scale"][e]))
                     for e, c in enumerate(counts))
        if not all(comm.allgather(ok)):
            raise moecomm.MoeCommError(f"{name}: GPU dispatch disagrees with the reference")

        # eager, per phase
        ev = [cp.cuda.Event() for _ in range(5)]
        samples = []
        for it in range(self.args.warmup + self.args.iters):
            self.barrier()
            ev[0].record(s)
            for i in range(4):
                phase(i, i < 2)
                ev[i + 1].record(s)
            ev[4].synchronize()
            if it >= self.args.warmup:
                samples.append([cp.cuda.get_elapsed_time(ev[i], ev[i + 1]) * 1e3 for i in range(4)])
        a2a.synchronize(s)
        eager = self.max_over_ranks(samples)

        eager_layer = self.eager_layer(calls)
        host_us = self.host_cost(a2a, d)

        # CUDA graphs: dispatch() + combine() (both halves each), the four half calls in sequence, then each
        # half alone (peers' earlier phases complete)
        graph = None
        if not self.args.no_graph:
            halves = self.capture(lambda: [phase(i, i < 2) for i in range(4)])
            graph = {"total": stats(self.time_graphs([self.capture(calls)], 0)),
                     "split_total": stats(self.time_graphs([halves], 0))}
            parts = [self.capture(lambda i=i: phase(i, i < 2)) for i in range(4)]
            for i, p in enumerate(PHASES):
                graph[p] = stats(self.time_graphs(parts, i))
            a2a.synchronize(s)

        # bytes this rank sends to other ranks
        owners = idx[rank] // L
        remote_ranks = [len(set(row) - {rank}) for row in owners]
        disp_bytes = sum(remote_ranks) * record_bytes(a2a.cfg)
        comb_row = _abi.combine_row_bytes(a2a.cfg)
        comb_bytes = sum(remote_ranks) * comb_row
        result = dict(config=name, tokens=tokens, experts=experts, topk=k, hidden=hidden, scales=scales,
                      world=W, routing=self.args.routing, weights_at_dispatch=True,
                      combine_wire=self.args.combine_wire, dispatch_wire=wire,
                      bytes={"dispatch": int(disp_bytes), "combine": int(comb_bytes), "combine_row": comb_row,
                             "dispatch_record": record_bytes(a2a.cfg)},
                      eager={p: stats(eager[:, i]) for i, p in enumerate(PHASES)})
        result["eager"]["total"] = stats(eager.sum(axis=1))
        result["eager_layer"], result["host_us"] = eager_layer, host_us
        if graph is not None:
            result["graph"] = graph
        best = result.get("graph", result["eager"])["total"]["median_us"]
        result["GBps_per_rank"] = (disp_bytes + comb_bytes) / (best * 1e-6) / 1e9
        if self.nccl:
            result["nccl"] = self.nccl_baseline(idx[rank], tokens, k, L, hidden, scales)
            result["speedup_vs_nccl_exact"] = result["nccl"]["exact"]["median_us"] / best
        a2a.destroy()
        return result

    def eager_layer(self, calls):
        """``calls()`` (dispatch() then combine(), both halves each), host in the loop: events around it."""
        cp, s = self.cp, self.stream
        ev = [cp.cuda.Event(), cp.cuda.Event()]
        samples = []
        for it in range(self.args.warmup + self.args.iters):
            self.barrier()
            ev[0].record(s)
            calls()
            ev[1].record(s)
            ev[1].synchronize()
            if it >= self.args.warmup:
                samples.append([cp.cuda.get_elapsed_time(ev[0], ev[1]) * 1e3])
        return stats(self.max_over_ranks(samples)[:, 0])

    def input_kinds(self, d):
        """The bench arrays as each kind of input a user passes: CuPy arrays (as they are), raw
        DeviceBuffers, and PyTorch tensors of the real dtypes (when torch is installed)."""
        cp, dev = self.cp, self.comm.device
        tokens = moecomm.bfloat16 if self.args.dispatch_wire else moecomm.float8_e4m3fn
        dtypes = dict(ex=moecomm.float8_e4m3fn, x=tokens, y=moecomm.bfloat16, out=moecomm.bfloat16)
        kinds = {"cupy": d, "buffer": {k: None if a is None else
                                       moecomm.DeviceBuffer(a.data.ptr, a.shape, dtypes.get(k, a.dtype), dev, a)
                                       for k, a in d.items()}}
        try:
            import torch
        except ImportError:
            return kinds
        views = dict(ex=torch.float8_e4m3fn, x=torch.bfloat16 if self.args.dispatch_wire else torch.float8_e4m3fn,
                     y=torch.bfloat16, out=torch.bfloat16)
        kinds["torch"] = {k: None if a is None else torch.from_dlpack(a).view(views[k]) if k in views else
                          torch.from_dlpack(a) for k, a in d.items()}
        cp.cuda.get_current_stream().synchronize()
        return kinds

    def host_cost(self, a2a, d, calls=50, reps=20):
        """Per input kind: host microseconds per eager dispatch (both halves) and combine (both halves), and
        the eager layer (:meth:`eager_layer`) with those inputs; CuPy and torch inputs also as prepared calls
        (``"<kind> prepared"``: AllToAll.prepare_dispatch / prepare_combine). For the host times the device is
        kept busy by a delay kernel queued first, so the launch queue never blocks the host; ``calls`` pairs per
        repetition (4 launches each, well under the queue depth)."""
        s, out = self.stream, {}
        runs = [(kind, a, prepared) for kind, a in self.input_kinds(d).items()
                for prepared in ((False,) if kind == "buffer" else (False, True))]
        for kind, a, prepared in runs:
            framework = nullcontext()
            if kind == "torch":  # the tensors' producer stream is torch's current one: make it ours
                import torch
                framework = torch.cuda.stream(torch.cuda.ExternalStream(s.ptr))
            if prepared:
                kind += " prepared"
                dispatch = a2a.prepare_dispatch(a["n"], a["ex"], a["es"], a["x"], a["xs"], a["idx"], a["m"],
                                                weights=a["w"], stream=s, out_expert_offsets=a.get("off"),
                                                tags=a["tags"])
                combine = a2a.prepare_combine(a["out"], a["idx"], None, a["y"], a["m"], stream=s)
            else:
                def dispatch(a=a):
                    a2a.dispatch(a["n"], a["ex"], a["es"], a["x"], a["xs"], a["idx"], a["m"], weights=a["w"],
                                 stream=s, out_expert_offsets=a.get("off"), tags=a["tags"])

                def combine(a=a):
                    a2a.combine(a["out"], a["idx"], None, a["y"], a["m"], stream=s)

            t = {"dispatch": [], "combine": []}
            with framework:
                for _ in range(reps):
                    self.barrier()
                    self.delay(20000)
                    for _ in range(calls):
                        t0 = time.perf_counter_ns()
                        dispatch()
                        t1 = time.perf_counter_ns()
                        combine()
                        t["combine"].append((time.perf_counter_ns() - t1) / 1e3)
                        t["dispatch"].append((t1 - t0) / 1e3)
                    s.synchronize()
                out[kind] = {phase: stats(v) for phase, v in t.items()}
                out[kind]["eager_layer"] = self.eager_layer(lambda: (dispatch(), combine()))
            a2a.synchronize(s)
        return out

    def nccl_baseline(self, idx, tokens, k, L, hidden, scales):
        """Standard all-to-all: one row per (token, expert); fp8+scales out, bf16 back."""
        nccl, comm = self.nccl
        cp, s, W = self.cp, self.stream, self.comm.world_size
        per_dest = np.bincount((idx // L).ravel(), minlength=W)
        recv_counts = np.asarray(self.comm.mpi.alltoall(per_dest.tolist()))
        out_row, back_row = hidden + 4 * scales, 2 * hidden
        out = {}
        for mode, sc, rc in (("exact", per_dest, recv_counts),
                             ("padded", np.full(W, tokens * k), np.full(W, tokens * k))):
            bufs = [cp.zeros(int(sc.sum()) * out_row, np.uint8), cp.zeros(int(rc.sum()) * out_row, np.uint8),
                    cp.zeros(int(rc.sum()) * back_row, np.uint8), cp.zeros(int(sc.sum()) * back_row, np.uint8)]

            def a2a(send, recv, scounts, rcounts, row):
                so = np.concatenate([[0], np.cumsum(scounts)]) * row
                ro = np.concatenate([[0], np.cumsum(rcounts)]) * row
                nccl.groupStart()
                for p in range(W):
                    comm.send(send.data.ptr + int(so[p]), int(scounts[p]) * row, nccl.NCCL_UINT8, p, s.ptr)
                    comm.recv(recv.data.ptr + int(ro[p]), int(rcounts[p]) * row, nccl.NCCL_UINT8, p, s.ptr)
                nccl.groupEnd()
            ev = [cp.cuda.Event() for _ in range(3)]
            samples = []
            for it in range(self.args.warmup + self.args.iters):
                self.start(ev[0])
                a2a(bufs[0], bufs[1], sc, rc, out_row)
                ev[1].record(s)
                a2a(bufs[2], bufs[3], rc, sc, back_row)
                ev[2].record(s)
                ev[2].synchronize()
                if it >= self.args.warmup:
                    samples.append([cp.cuda.get_elapsed_time(ev[0], ev[1]) * 1e3,
                                    cp.cuda.get_elapsed_time(ev[1], ev[2]) * 1e3])
            t = self.max_over_ranks(samples)
            out[mode] = dict(stats(t.sum(axis=1)), dispatch=stats(t[:, 0]), combine=stats(t[:, 1]))
        return out


def environment():
    import cupy
    import importlib.metadata as md
    info = {"host": platform.node(), "python": platform.python_version()}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
        info["gpus"] = q
    except (OSError, subprocess.SubprocessError):
        info["gpus"] = []
    info["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
    info["versions"] = {}
    for p in ("cupy-cuda13x", "cuda-bindings", "cuda-core", "nvidia-cuda-nvrtc", "nvidia-nvjitlink",
              "nvidia-nvshmem-cu13", "nvshmem4py-cu13", "mpi4py", "numpy", "nvidia-nccl-cu13", "torch"):

        try:
            info["versions"][p] = md.version(p)
        except md.PackageNotFoundError:
            pass
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                            cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        info["git_commit"] = ""
    return info


def _variant(r):
    """A result's transport, and its telemetry settings when they are not the defaults."""
    name = r.get("transport", "nvshmem")
    if r.get("telemetry_window", 64) != 64:
        name += f" w{r['telemetry_window']}"
    name += " packed" if r.get("layout") == "packed" else ""
    name += f" {r['combine_wire']}" if r.get("combine_wire") else ""
    name += f" bf16→{r['dispatch_wire']}" if r.get("dispatch_wire") else ""
    name += f" tags{r['tags']}" if r.get("tags") else ""
    name += " gap" if r.get("score_gap") else ""
    return name + (" timing" if r.get("timing") else "")


def _label(r):
    return f"{_variant(r)} {r['config']}"


def table(results):
    head = (f"{'transport, config':<20} {'tok':>5} {'eager d-send':>12} {'d-recv':>8} {'c-send':>8} {'c-recv':>8} "
            f"{'eager tot':>10} {'p99':>8} {'graph tot':>10} {'p99':>8} {'split':>8} {'GB/s':>7} {'NCCL exact':>11} "
            f"{'padded':>8} {'x NCCL':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        e, g, n = r["eager"], r.get("graph", {}).get("total"), r.get("nccl")
        split = r.get("graph", {}).get("split_total")
        lines.append(
            f"{_label(r):<20} {r['tokens']:>5} "
            + " ".join(f"{e[p]['median_us']:>{8 if i else 12}.1f}" for i, p in enumerate(PHASES))
            + f" {e['total']['median_us']:>10.1f} {e['total']['p99_us']:>8.1f}"
            + (f" {g['median_us']:>10.1f} {g['p99_us']:>8.1f}" if g else f" {'-':>10} {'-':>8}")
            + (f" {split['median_us']:>8.1f}" if split else f" {'-':>8}")
            + f" {r['GBps_per_rank']:>7.1f}"
            + (f" {n['exact']['median_us']:>11.1f} {n['padded']['median_us']:>8.1f} {r['speedup_vs_nccl_exact']:>7.2f}"
               if n else f" {'n/a':>11} {'n/a':>8} {'-':>7}"))
    if any("graph" in r for r in results):
        head = f"{'graph, each phase alone':<28} {'tok':>5} " + " ".join(f"{p:>14}" for p in PHASES) + f" {'sum':>8}"
        lines += ["", head, "-" * len(head)]
        for r in (r for r in results if "graph" in r):
            g = r["graph"]
            lines.append(f"{_label(r):<28} {r['tokens']:>5} " + " ".join(f"{g[p]['median_us']:>14.1f}" for p in PHASES)
                         + f" {sum(g[p]['median_us'] for p in PHASES):>8.1f}")
    hosts = [r for r in results if "host_us" in r]
    if hosts:
        kinds = sorted({k for r in hosts for k in r["host_us"]})
        head = (f"{'host us per call; eager layer':<28} {'tok':>5} "
                + " ".join(f"{k + ' d/c; layer':>21}" for k in kinds) + f" {'graph':>8}")
        lines += ["", head, "-" * len(head)]
        for r in hosts:
            h, g = r["host_us"], r.get("graph", {}).get("total")
            per_kind = " ".join(f"{h[k]['dispatch']['median_us']:>6.1f}/{h[k]['combine']['median_us']:<6.1f}"
                                f"{h[k]['eager_layer']['median_us']:>8.1f}" if k in h else f"{'-':>21}"
                                for k in kinds)
            lines.append(f"{_label(r):<28} {r['tokens']:>5} {per_kind}" + (f" {g['median_us']:>8.1f}" if g else ""))
    return "\n".join(lines)


def require_matplotlib(parser, path):
    """Exit with the parser's usage error when a plot is asked for (``path``) and matplotlib is missing."""
    if path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error(f"--plot {path}: needs matplotlib (pip install 'moecomm[plot]')")


def written(results, json_path, png):
    """Draw the plot when one is asked for (``png``); the line saying what was written."""
    if not png:
        return f"wrote {json_path}"
    if plot(results, png):
        return f"wrote {json_path} and {png}"
    return f"wrote {json_path} (no plot: it draws the sweep config)"


def plot(results, path):
    """The token sweep: per transport moecomm eager and CUDA-graph medians; NCCL's from the first."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    transports = list(dict.fromkeys(_variant(r) for r in results if r["config"] == "sweep"))
    if not transports:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in transports:
        sweep = sorted((r for r in results if r["config"] == "sweep" and _variant(r) == name),
                       key=lambda r: r["tokens"])
        t = [r["tokens"] for r in sweep]
        ax.plot(t, [r["eager"]["total"]["median_us"] for r in sweep], "o-",
                label=f"moecomm {name} eager, each half its own call")
        if "eager_layer" in sweep[0]:
            ax.plot(t, [r["eager_layer"]["median_us"] for r in sweep], "o-",
                    label=f"moecomm {name} eager, dispatch() + combine()")
        if "graph" in sweep[0]:
            ax.plot(t, [r["graph"]["total"]["median_us"] for r in sweep], "o-",
                    label=f"moecomm {name} CUDA graph, dispatch() + combine()")
        if "split_total" in sweep[0].get("graph", {}):
            ax.plot(t, [r["graph"]["split_total"]["median_us"] for r in sweep], "o:",
                    label=f"moecomm {name} CUDA graph, each half its own call")
    sweep = sorted((r for r in results if r["config"] == "sweep" and _variant(r) == transports[0]),
                   key=lambda r: r["tokens"])
    t = [r["tokens"] for r in sweep]
    if "nccl" in sweep[0]:
        ax.plot(t, [r["nccl"]["exact"]["median_us"] for r in sweep], "s--", label="NCCL all-to-all, exact")
        ax.plot(t, [r["nccl"]["padded"]["median_us"] for r in sweep], "s:", label="NCCL all-to-all, padded")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("dispatch + combine, median (us)")
    ax.set_title(f"R1 shapes (7168 hidden, 256 experts, top-8), EP{sweep[0]['world']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m moecomm.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="r1-decode,r1-prefill",
                   help="comma list of r1-decode, r1-prefill, v2-lite, sweep (default: the first two)")
    p.add_argument("--routing", default="uniform", choices=["uniform", "zipf", "hot"],
                   help="how tokens pick experts (default uniform)")
    p.add_argument("--iters", type=int, default=1000, help="timed iterations per case (default 1000)")
    p.add_argument("--warmup", type=int, default=50, help="untimed iterations first (default 50)")
    p.add_argument("--seed", type=int, default=0, help="routing seed (default 0)")
    p.add_argument("--no-graph", action="store_true", help="time eager calls only (no CUDA-graph replays)")
    p.add_argument("--delay-us", type=float, default=100.0,
                   help="device delay before each timed graph replay or NCCL call (default 100)")
    p.add_argument("--sweep-tokens", default=",".join(map(str, SWEEP_TOKENS)),
                   help="comma list of tokens per rank for the sweep config (default %(default)s)")
    p.add_argument("--json", default="bench.json", help="output JSON (rank 0)")
    p.add_argument("--plot", metavar="PNG", help="also draw the sweep here (rank 0; needs matplotlib: pip install "
                   "'moecomm[plot]')")
    p.add_argument("--transport", default="nvshmem", choices=["nvshmem", "ipc"], help="GPU transport (default nvshmem)")
    p.add_argument("--telemetry-window", type=int, default=64, help="AllToAll(telemetry_window=...); 0: off")
    p.add_argument("--timing", action="store_true", help="AllToAll(timing=True): CUDA events per phase")
    p.add_argument("--tags", type=int, default=0, help="AllToAll(num_tags=...), each token a random tag")
    p.add_argument("--score-gap", action="store_true", help="AllToAll(score_gap=True): router confidence counted")
    p.add_argument("--layout", default="padded", choices=["padded", "packed"], help="AllToAll(layout=...)")
    p.add_argument("--combine-wire", default=None, choices=["e4m3", "e4m3_ue8m0"],
                   help="AllToAll(combine_wire=...): combine's rows as FP8 (default: bf16)")
    p.add_argument("--dispatch-wire", default=None, choices=["e4m3", "e4m3_ue8m0"],
                   help="AllToAll(dispatch_wire=...): bf16 tokens quantised by dispatch (default: FP8 tokens given)")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="no measurement: join these result files (e.g. one per transport) into --json and --plot")
    args = p.parse_args(argv)
    require_matplotlib(p, args.plot)
    if args.merge:
        return merge(args.merge, args.json, args.plot, p)
    jobs = []
    for name in args.configs.split(","):
        if name == "sweep":
            try:
                tokens = [int(t) for t in args.sweep_tokens.split(",")]
            except ValueError:
                p.error(f"--sweep-tokens: expected a comma list of integers, got {args.sweep_tokens!r}")
            jobs += [("sweep", (t,) + CONFIGS["r1-decode"][1:]) for t in tokens]
        elif name in CONFIGS:
            jobs.append((name, CONFIGS[name]))
        else:
            p.error(f"unknown config {name!r}; expected {', '.join(list(CONFIGS) + ['sweep'])}")
    if gpu_count() == 0:
        p.exit(2, f"{p.prog}: needs GPUs (one per rank, under mpirun) and this process sees none\n")
    try:
        return measure(args, jobs, argv)
    except moecomm.MoeCommError as e:
        print(f"{p.prog}: {e}", file=sys.stderr)
        return 1


def measure(args, jobs, argv):
    """Every configuration in ``jobs`` (collective); rank 0 prints the tables and writes the files."""
    comm = moecomm.init(transport=args.transport)
    bench = Bench(comm, args)
    floor = None if args.no_graph else bench.launch_floor()
    results, t0 = [], time.time()
    for i, (name, c) in enumerate(jobs):
        results.append(dict(bench.run(name, *c), transport=args.transport, telemetry_window=args.telemetry_window,
                            timing=args.timing, layout=args.layout, tags=args.tags, score_gap=args.score_gap))
        if comm.rank == 0:
            done = (i + 1) / len(jobs)
            print(f"\r[{'#' * int(30 * done):<30}] {i + 1}/{len(jobs)} {name} {c[0]} tokens "
                  f"({time.time() - t0:.0f} s)", file=sys.stderr, end="\n" if i + 1 == len(jobs) else "",
                  flush=True)
    if comm.rank == 0:
        print(table(results))
        if floor:
            print(f"graph launch floor (one empty kernel, timed like a phase): {floor['median_us']:.1f} us")
        doc = {"command": "mpirun -np {} python -m moecomm.bench {}".format(comm.world_size, " ".join(
            argv if argv is not None else sys.argv[1:])), "environment": environment(),
            "nccl_baseline": bench.nccl is not None, "iters": args.iters, "warmup": args.warmup,
            "delay_us": args.delay_us, "graph_launch_floor": floor, "transport": args.transport,
            "results": results}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(written(results, args.json, args.plot))
    comm.finalize()


def merge(paths, out_json, out_plot, parser):
    """Join result files of one machine (one per transport, say) into one document: every run's command,
    environment and settings under "runs", every result (each naming its transport) under "results"."""
    docs = []
    for path in paths:
        try:
            with open(path) as f:
                docs.append(json.load(f))
        except (OSError, ValueError) as e:
            parser.exit(2, f"{parser.prog}: --merge: cannot read {path}: {e}\n")
    runs = [{k: v for k, v in d.items() if k != "results"} for d in docs]
    results = [dict(r, transport=r.get("transport", d.get("transport", "nvshmem"))) for d in docs for r in d["results"]]
    with open(out_json, "w") as f:
        json.dump({"runs": runs, "results": results}, f, indent=1)
    print(table(results))
    print(written(results, out_json, out_plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
