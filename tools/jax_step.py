"""Jitted JAX steps of MoE layers through moecomm.jax against the same kernels in a CUDA graph and the same
layers with XLA alone, R1-decode shapes (128 tokens, 7168 hidden, 256 experts, top-8), one GPU per rank.

    mpirun -np 1 python tools/jax_step.py [--layer exchange,simple,moe,train] [--json jax-step.json]
    mpirun -np 1 python tools/jax_step.py --small --require-captured     # the GPU suite's capture test

Layers (a row's ``"layer"``), each stacked ``--layers`` deep, ``"form"`` ``unrolled`` (a Python loop in the
jitted function) or ``scan`` (``lax.scan`` over the layers):

- ``exchange``: dispatch (router weights sent with it) -> combine, routing given as data per layer; in
  bfloat16 combine reads dispatch's own buffer, in FP8 (e4m3 tokens, 56 float32 scales) a fixed bfloat16
  output per expert. No XLA work between the halves: the kernels' own cost inside a jitted step.
- ``simple``: the same with ``(expert_x.astype(float32) * 2).astype(bfloat16)`` between the halves, over the
  worst-case slots (bfloat16).
- ``moe``: a whole layer: RMS norm, router (matmul, ``top_k``, softmax), dispatch, every local expert's
  ``silu(x @ w1) @ w2`` (``--ffn`` wide; einsums over the padded slots) with ``capacity`` = 2 x the mean
  (``overflow="drop"``), combine, residual add. bfloat16, and FP8: e4m3 with a float32 scale per 128 values,
  quantised and dequantised by XLA in the step.
- ``train``: one SGD step of ``jax.value_and_grad`` of a loss over the ``moe`` stack (bfloat16), each layer
  under ``jax.checkpoint`` (its forward runs again in the backward pass), the parameters donated.

Every row is checked first. ``exchange`` and ``simple`` against moecomm.reference on fresh random tokens,
routing and m, the whole stack, and again with another m on the same compiled step (a stale capture of the
first m would fail it); ``moe`` layer by layer against numpy (each layer's routing and input taken from the
step as data: a router re-routes near-tied tokens under any rounding difference), at a small m (no expert
overflows) and at m = 128 (the tokens of overflowing experts left out, the counts checked); ``train``: the
loss and every gradient of a one-layer stack against the same layer with XLA alone (JAX's own autodiff), at a
small m.

Timed (medians over ``--rounds``): ``per_layer_us``, ``--steps`` steps queued back to back then waited for,
per layer; ``step_us``, one step at a time; ``graph_us``, the kernels the layer runs, in a CUDA graph with
moecomm alone, timed as moecomm.bench times graphs (dispatch + combine; ``train``: twice that, the
checkpointed forward runs again, plus combine_backward + dispatch_backward, also given apart as
``graph_forward_us`` / ``graph_backward_us``); ``graph_step_us`` (``exchange``), the layers' calls in one
CUDA graph launched one at a time; ``xla_only_per_layer_us`` / ``xla_only_step_us``, the same step with XLA
alone: for ``exchange`` one fused op per layer, for the others the exchange replaced by a local scatter into
the same padded slots and a gather back; ``between_us`` (``simple``), the op between the halves alone over the
same slots, per layer, and ``between_bytes``, what it reads and writes (the floor under the simple form:
combine takes the whole buffer, so XLA must write every slot). ``handler_runs``: how often moecomm.jax's
handlers ran (Python) in the timed steps, after a warm-up round of the same pattern (``warmup_handler_runs``:
XLA traces each call once per set of its buffers' addresses, up to its trace cache); 0: XLA replayed its
command buffers. With ``--require-captured`` any other count fails the run. ``native_per_layer_us``: the
exchange the JAX-native way (``lax.ragged_all_to_all``; ``--native``).
Prints a table; writes the JSON (command, GPU, versions, rows).
"""
import argparse
import json
import os
import sys
import time
from types import SimpleNamespace
from typing import NamedTuple

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # CuPy and JAX share the GPU

import jax  # noqa: E402  (imports no backend: moecomm.init() may come first or after)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import moecomm  # noqa: E402
from moecomm import reference  # noqa: E402
from moecomm.reference import relative_error  # noqa: E402
from moecomm.bench import Bench, environment, stats  # noqa: E402


class Shapes(NamedTuple):
    tokens: int   # max tokens per rank (T)
    experts: int  # E
    topk: int     # K
    hidden: int   # H
    ffn: int      # an expert's inner width (moe, train)

    @property
    def scales(self):  # FP8: one float32 scale per BLOCK values
        return self.hidden // BLOCK


BLOCK = 128  # values per FP8 scale
R1_DECODE = Shapes(128, 256, 8, 7168, 64)
SMALL = Shapes(32, 16, 4, 512, 32)  # --small: the capture test's
TOL = 2e-2
E4M3_MAX = 448.0


# the model: plain JAX, over an exchange (moecomm.jax's or XLA's own) ------------------------------------
def rms_norm(x, g):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6) * g).astype(jnp.bfloat16)


def route(h, wr, k):
    """(ids [rows, k] int32, weights [rows, k] float32): the top-k logits' softmax."""
    logits, ids = jax.lax.top_k(jnp.einsum("th,he->te", h, wr, preferred_element_type=jnp.float32), k)
    return ids.astype(jnp.int32), jax.nn.softmax(logits, -1)


def quantize(h):
    """bfloat16 [rows, H] -> (e4m3 [rows, H], float32 scales [rows, H / BLOCK]): amax / 448 per block."""
    b = h.astype(jnp.float32).reshape(h.shape[0], -1, BLOCK)
    s = jnp.maximum(jnp.abs(b).max(-1), 1e-12) / E4M3_MAX
    return (b / s[..., None]).astype(jnp.float8_e4m3fn).reshape(h.shape), s


def dequantize(q, s):
    """e4m3 [..., H] with float32 scales [..., H / BLOCK] -> bfloat16."""
    b = q.astype(jnp.float32).reshape(*q.shape[:-1], -1, BLOCK) * s[..., None]
    return b.reshape(q.shape).astype(jnp.bfloat16)


def experts(x, w1, w2):
    """Every local expert over its slots: x [L, C, H] bfloat16 -> silu(x @ w1) @ w2, [L, C, H] bfloat16."""
    a = jnp.einsum("lch,lhf->lcf", x, w1, preferred_element_type=jnp.float32)
    a = jax.nn.silu(a).astype(jnp.bfloat16)
    return jnp.einsum("lcf,lfh->lch", a, w2, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


class Moecomm:
    """The exchange through moecomm.jax (dispatch -> experts -> combine)."""

    def __init__(self, layer):
        self.layer = layer

    def dispatch(self, x, xs, ids, m, w):
        _, ex, exs = self.layer.dispatch(x, xs, ids, m, w)
        return ex, exs, None

    def combine(self, ctx, ids, w, y, m):
        return self.layer.combine(ids, w, y, m)


class Local:
    """The exchange with XLA alone, one rank: each (token, expert) pair scattered into its expert's next padded
    slot (``capacity`` slots, pairs past it dropped, tokens >= m not sent), and gathered back as the router-
    weighted sum (float32, then bfloat16)."""

    def __init__(self, experts_, capacity):
        self.experts, self.capacity = experts_, capacity

    def dispatch(self, x, xs, ids, m, w):
        rows, k = ids.shape
        flat = ids.reshape(-1)
        sent = jnp.repeat(jnp.arange(rows) < m[0], k)
        hot = (flat[:, None] == jnp.arange(self.experts)[None]) & sent[:, None]
        slot = jnp.where(hot, jnp.cumsum(hot, 0) - 1, 0).sum(1)
        keep = sent & (slot < self.capacity)
        e, s = jnp.where(keep, flat, self.experts), jnp.where(keep, slot, 0)  # out of range: dropped
        scatter = lambda a: jnp.zeros((self.experts, self.capacity) + a.shape[1:], a.dtype).at[e, s].set(  # noqa
            jnp.repeat(a, k, 0), mode="drop")
        return scatter(x), None if xs is None else scatter(xs), (e, s, keep)

    def combine(self, ctx, ids, w, y, m):
        e, s, keep = ctx
        rows, k = ids.shape
        got = y[jnp.minimum(e, self.experts - 1), s].astype(jnp.float32) * jnp.where(keep, w.reshape(-1), 0)[:, None]
        return got.reshape(rows, k, -1).sum(1).astype(jnp.bfloat16)


def moe_block(p, x, m, ex_, fp8, k, probe=None):
    """One MoE layer on x [rows, H] bfloat16 with parameters p (g [H], wr [H, E], w1 [L, H, F], w2 [L, F, H]);
    ``probe``: a list the layer appends its routing and dispatch input to (the check's)."""
    h = rms_norm(x, p["g"])
    ids, w = route(h, p["wr"], k)
    if fp8:
        q, s = quantize(h)
        ex, exs, ctx = ex_.dispatch(q, s, ids, m, w)
        xin = dequantize(ex, exs)
    else:
        xin, _, ctx = ex_.dispatch(h, None, ids, m, w)
    if probe is not None:
        probe.append((x, h, ids, w))
    return x + ex_.combine(ctx, ids, w, experts(xin, p["w1"], p["w2"]), m)


def init_params(rng, shapes, layers, local):
    """Per layer: g [H], wr [H, E], w1 [L, H, F], w2 [L, F, H] (bfloat16), stacked over the layers."""
    T, E, K, H, F = shapes
    bf = moecomm.bfloat16
    return dict(g=(1 + 0.1 * rng.standard_normal((layers, H))).astype(np.float32),
                wr=(rng.standard_normal((layers, H, E)) / np.sqrt(H)).astype(bf),
                w1=(rng.standard_normal((layers, local, H, F)) / np.sqrt(H)).astype(bf),
                w2=(rng.standard_normal((layers, local, F, H)) / np.sqrt(F)).astype(bf))


def stack_fns(block, layers):
    """(unrolled, scanned): ``block(p, x)`` over the layers' parameters (stacked; unrolled: a list)."""

    def unrolled(params, x):
        for p in params:
            x = block(p, x)
        return x

    def scanned(params, x):
        return jax.lax.scan(lambda c, p: (block(p, c), None), x, params)[0]
    return {"unrolled": unrolled, "scan": scanned}


def per_layer(params, layers):
    """The stacked parameters as a list of one dict per layer (the unrolled form's)."""
    return [{k: v[n] for k, v in params.items()} for n in range(layers)]


# numpy references -------------------------------------------------------------------------------------
def f32(a):
    return np.asarray(a, np.float32)


def numpy_block(x, h, ids, w, m, p, fp8, capacity, experts_):
    """One rank (world size 1) of a moe layer in numpy from the step's own routing and dispatch input: (out
    [m, H] float32, the tokens to compare: those none of whose pairs went to an expert past its capacity)."""
    bf = moecomm.bfloat16
    ids, w = np.asarray(ids)[:m], f32(w)[:m]
    h = np.asarray(h)[:m]
    if fp8:
        b = f32(h).reshape(m, -1, BLOCK)
        s = np.maximum(np.abs(b).max(-1), np.float32(1e-12)) / np.float32(E4M3_MAX)
        q = (b / s[..., None]).astype(moecomm.float8_e4m3fn)
        xin = (f32(q) * s[..., None]).reshape(m, -1).astype(bf)
    else:
        xin = h
    load = np.bincount(ids.reshape(-1), minlength=experts_)
    clean = (load[ids] <= capacity).all(1)
    acc = np.zeros((m, xin.shape[1]), np.float32)
    for e in np.unique(ids):
        t, j = np.nonzero(ids == e)
        a = f32(xin[t]) @ f32(p["w1"][e])
        a = (a / (1 + np.exp(-a))).astype(bf)
        y = (f32(a) @ f32(p["w2"][e])).astype(bf)
        acc[t] += w[t, j][:, None] * f32(y)
    return f32((f32(x[:m]) + f32(acc.astype(bf))).astype(bf)), clean


def check_moe(block_for, params, shapes, fp8, capacity, put, rng, form, layers):
    """The moe stack layer by layer against numpy (world size 1) at a small m and at the full batch; raises
    SystemExit on a mismatch. Returns how many (layer, token) outputs were compared."""
    T, E, K, H, F = shapes
    compared = 0

    def probed(params, x, mm):
        """The stack's output and each layer's (input, dispatch input, ids, weights), stacked."""
        if form == "scan":
            def body(c, p):
                probe = []
                return block_for(p, c, mm, probe), probe[0]
            return jax.lax.scan(body, x, params)
        probe = []
        for p in per_layer(params, layers):
            x = block_for(p, x, mm, probe)
        return x, tuple(jnp.stack(col) for col in zip(*probe))
    step = jax.jit(probed)
    for m in (max(1, capacity * E // (8 * K)), T):  # mean load 1/4 of the capacity: no expert overflows
        x = rng.standard_normal((T, H)).astype(moecomm.bfloat16)
        out, probe = step(params, put(x), put(np.array([m], np.int32)))
        xs, hs, ids, ws = (np.asarray(a) for a in probe)
        outs = list(xs[1:]) + [np.asarray(out)]
        host = {k: np.asarray(v) for k, v in params.items()}
        for n in range(layers):
            p = {k: v[n] for k, v in host.items()}
            want, clean = numpy_block(xs[n], hs[n], ids[n], ws[n], m, p, fp8, capacity, E)
            got = f32(outs[n])[:m]
            err = relative_error(got[clean] - f32(xs[n])[:m][clean], want[clean] - f32(xs[n])[:m][clean])
            if not err < TOL or not np.isfinite(got).all():
                raise SystemExit(f"jax_step.py: moe {'fp8' if fp8 else 'bf16'} {form}, m={m}, layer {n}: relative "
                                 f"error {err:.3g} of the layer's update against numpy ({clean.sum()} tokens)")
            if m < T and not clean.all():
                raise SystemExit(f"jax_step.py: moe check at m={m}: an expert overflowed; the check wants none")
            compared += int(clean.sum())
    return compared


# timing -----------------------------------------------------------------------------------------------
def timed(run, args, layers):
    """(pipelined µs per layer, one step at a time µs) of ``run()`` (one step; returns what to wait for),
    medians over the rounds."""
    for _ in range(20):
        out = run()
    wait(out)
    queued, single = [], []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for _ in range(args.steps):
            out = run()
        wait(out)
        queued.append(1e6 * (time.perf_counter() - t0) / (args.steps * layers))
        for _ in range(20):
            t0 = time.perf_counter()
            wait(run())
            single.append(1e6 * (time.perf_counter() - t0))
    return queued, single


def wait(out):
    jax.block_until_ready(out)


def counted(layers_, fn):
    """(what ``fn()`` returns, how often the handlers of ``layers_`` ran meanwhile)."""
    before = sum(lay.handler_runs for lay in layers_)
    out = fn()
    return out, sum(lay.handler_runs for lay in layers_) - before


def row_times(run, args, layers, watched):
    """The timed figures of one row: a warm-up round of the timed pattern (XLA's first executions run op by op,
    and XLA traces moecomm's calls once per set of buffer addresses, which steps queued back to back and steps
    run one at a time place differently), then handler runs counted over the timed steps."""
    _, warmup_runs = counted(watched, lambda: timed(run, argparse.Namespace(rounds=1, steps=args.steps), layers))
    (queued, single), runs = counted(watched, lambda: timed(run, args, layers))
    return dict(per_layer_us=float(np.median(queued)), per_layer_spread_us=[min(queued), max(queued)],
                step_us=float(np.median(single)), step_p99_us=float(np.percentile(single, 99)),
                handler_runs=runs, timed_steps=20 + args.rounds * (args.steps + 20), warmup_handler_runs=warmup_runs)


def graph_times(bench, a2a, fp8, layers, backward=False, slots_y=None):
    """Median µs of dispatch + combine of one layer in a CUDA graph (moecomm's kernels alone), of a graph of
    ``layers`` such layers launched and waited for one at a time, and with ``backward`` of combine_backward +
    dispatch_backward in a graph."""
    cp = bench.cp
    T, E, K, H = a2a.cfg.max_num_tokens, a2a.cfg.num_experts, a2a.cfg.experts_per_token, a2a.cfg.hidden_dim
    S = a2a.cfg.hidden_dim_scale
    rng = np.random.default_rng(9)
    shape = a2a.cfg.expert_x_shape()
    bf = lambda a: moecomm.DeviceBuffer(a.data.ptr, a.shape, np.dtype(moecomm.bfloat16), a.data.device_id, a)  # noqa
    with bench.stream:
        x = cp.asarray(rng.integers(0, 255, (T, H), np.uint8) & 0x77) if fp8 else \
            cp.asarray(rng.standard_normal((T, H), np.float32).astype(moecomm.bfloat16).view(np.uint16))
        d = dict(x=x, xs=cp.asarray(rng.random((T, S), np.float32)) if fp8 else None,
                 idx=cp.asarray(np.argsort(rng.random((T, E)), 1)[:, :K].astype(np.int32)),
                 w=cp.asarray(rng.random((T, K), np.float32)), m=cp.asarray(np.array([T], np.int32)),
                 n=cp.zeros(shape[0], np.int32), ex=cp.zeros(shape, np.uint8 if fp8 else np.uint16),
                 es=cp.zeros(shape[:-1] + (S,), np.float32) if fp8 else None,
                 y=cp.full(shape, 0x3C00, np.uint16), out=cp.zeros((T, H), np.uint16))
        y = d["y"] if fp8 or slots_y else d["ex"]
        if not fp8:
            d["x"] = bf(d["x"])

        def calls():
            a2a.dispatch(d["n"], d["ex"] if fp8 else bf(d["ex"]), d["es"], d["x"], d["xs"], d["idx"], d["m"],
                         weights=d["w"], stream=bench.stream)
            a2a.combine(bf(d["out"]), d["idx"], None, bf(y), d["m"], stream=bench.stream)
        calls()
        a2a.synchronize(bench.stream)
        out = dict(graph_forward_us=stats(bench.time_graphs([bench.capture(calls)], 0))["median_us"])
        stack = bench.capture(lambda: [calls() for _ in range(layers)])
        single = []
        for _ in range(120):  # launched and waited for from the host, as one jitted step at a time is
            t0 = time.perf_counter()
            stack.launch(bench.stream)
            bench.stream.synchronize()
            single.append(1e6 * (time.perf_counter() - t0))
        out["graph_step_us"] = float(np.median(single[20:]))
        if backward:
            plan = moecomm.RoutingPlan(*(cp.zeros(p, np.int32) for p in a2a.plan_shapes()))
            g = dict(gout=cp.asarray(rng.standard_normal((T, H), np.float32).astype(moecomm.bfloat16).view(
                np.uint16)), gx=cp.zeros((T, H), np.uint16), gw=cp.zeros((T, K), np.float32),
                gy=cp.zeros(shape, np.uint16), gex=cp.full(shape, 0x3C00, np.uint16))
            calls()
            a2a.plan(plan, bench.stream)

            def backward_calls():
                a2a.combine_backward(bf(g["gy"]), g["gw"], plan, bf(g["gout"]), d["w"], bf(y), d["m"],
                                     stream=bench.stream)
                a2a.dispatch_backward(bf(g["gx"]), plan, bf(g["gex"]), d["m"], stream=bench.stream)
            backward_calls()
            a2a.synchronize(bench.stream)
            out["graph_backward_us"] = stats(bench.time_graphs([bench.capture(calls),
                                                                bench.capture(backward_calls)], 1))["median_us"]
        out["graph_us"] = (2 * out["graph_forward_us"] + out["graph_backward_us"] if backward
                           else out["graph_forward_us"])
        return out


# the rows ---------------------------------------------------------------------------------------------
def draw_exchange(rng, W, layers, m, shapes):
    """Every rank's inputs of one exchange step (every rank draws them all): tokens, scales, ids and weights
    per layer."""
    T, E, K, H, _ = shapes
    x = [rng.standard_normal((T, H), np.float32).astype(moecomm.bfloat16) for _ in range(W)]
    xs = [(rng.random((T, shapes.scales), np.float32) + 0.5).astype(np.float32) for _ in range(W)]
    ids = [np.stack([np.argsort(rng.random((T, E)), 1)[:, :K] for _ in range(layers)]).astype(np.int32)
           for _ in range(W)]
    w = [(rng.random((layers, T, K), np.float32) / K).astype(np.float32) for _ in range(W)]
    return x, xs, ids, w, m


def reference_exchange(inputs, fp8, layers, rank, W, y_expert, shapes, scale):
    """This rank's output of an exchange stack (``scale``: the op between the halves multiplies by it), layer
    after layer with the kernels' rounding."""
    T, E, K, H, _ = shapes
    x, xs, ids, w, m = inputs
    cur = [xi[:m] for xi in x]
    for n in range(layers):
        if fp8:
            xin = [c.astype(np.float32).astype(moecomm.float8_e4m3fn) for c in cur]
            ref = reference.dispatch(xin, [s[:m] for s in xs], [i[n][:m] for i in ids], E, W, T)
            y = [np.broadcast_to(y_expert[q * (E // W):(q + 1) * (E // W), :, None],
                                 r["expert_x"].shape).astype(moecomm.bfloat16) for q, r in enumerate(ref)]
        else:
            ref = reference.dispatch(cur, None, [i[n][:m] for i in ids], E, W, T)
            y = [(f32(r["expert_x"]) * scale).astype(moecomm.bfloat16) for r in ref]
        cur = reference.combine([i[n][:m] for i in ids], [wi[n][:m] for wi in w], y, [r["origin"] for r in ref], E,
                                W, moecomm.bfloat16)
    return cur[rank]


class Ctx(NamedTuple):
    comm: object
    put: object
    bench: object
    args: object
    shapes: Shapes


def exchange_rows(ctx, dtype, scale):
    """The exchange rows (``scale`` None) or the simple form's (bfloat16, x ``scale`` between the halves)."""
    comm, put, args, sh = ctx.comm, ctx.put, ctx.args, ctx.shapes
    import moecomm.jax as mj
    W, r = comm.world_size, comm.rank
    T, E, K, H, _ = sh
    L = E // W
    fp8 = dtype == "float8_e4m3fn"
    y_expert = (np.arange(E, dtype=np.float32) % 17 / 16 + 0.25).astype(moecomm.bfloat16)[:, None]  # [E, 1]
    a2a = moecomm.AllToAll(comm, T, E, K, H, sh.scales if fp8 else None, dtype, "bfloat16")
    layer = mj.AllToAll(a2a)
    slots = a2a.cfg.expert_x_shape()[1]
    y_local = put(jnp.broadcast_to(jnp.asarray(y_expert[r * L:(r + 1) * L, :, None] * np.ones((1, 1, H)),
                                               jnp.bfloat16), (L, slots, H)))

    def between(ex):
        return (ex.astype(jnp.float32) * scale).astype(jnp.bfloat16)

    def moe(x, xs, ids, w, m):
        counts, ex, _ = layer.dispatch(x.astype(dtype) if fp8 else x, xs if fp8 else None, ids, m, w)
        if fp8:  # m itself (counts >= 0), after the dispatch
            return layer.combine(ids, None, y_local, jnp.where(counts[:1] < 0, 0, m))
        return layer.combine(ids, None, ex if scale is None else between(ex), m)

    def unrolled(x, xs, ids, w, m):
        for n in range(args.layers):
            x = moe(x, xs, ids[n], w[n], m)
        return x

    def scanned(x, xs, ids, w, m):
        return jax.lax.scan(lambda c, p: (moe(c, xs, p[0], p[1], m), None), x, (ids, w))[0]
    forms = {"unrolled": unrolled, "scan": scanned}
    rows = []
    for form in args.forms:
        step = jax.jit(forms[form])
        rng = np.random.default_rng([r, 5])
        for m in (T - 17, T):  # the second on the same compiled step: no stale capture of the first
            inputs = draw_exchange(rng, W, args.layers, m, sh)
            dev_in = [put(a[r]) for a in inputs[:4]] + [put(np.array([m], np.int32))]
            got = f32(step(*dev_in))[:m]
            want = f32(reference_exchange(inputs, fp8, args.layers, r, W, y_expert, sh, scale or 1.0))
            err = relative_error(got, want)
            if not err < TOL:
                raise SystemExit(f"jax_step.py: {dtype} {form}, m={m}: relative error {err:.3g} against "
                                 f"moecomm.reference")
        layer.check()
        row = dict(layer="exchange" if scale is None else "simple", config="r1-decode", world=W, form=form,
                   dtype=dtype, layers=args.layers, checked_tokens=2 * T - 17)
        row.update(row_times(lambda: step(*dev_in), args, args.layers, [layer]))
        layer.check()
        if scale is None:  # XLA alone: one fused op per layer
            def op(x, w):
                return (x.astype(jnp.float32) * w.sum(1, keepdims=True)).astype(x.dtype)
            xla_fns = stack_fns(lambda w, x: op(x, w), args.layers)
            xla_w = dev_in[3] if form == "scan" else [dev_in[3][n] for n in range(args.layers)]
            xla = jax.jit(xla_fns[form])
            run = lambda: xla(xla_w, dev_in[0])  # noqa: E731
        else:  # XLA alone: the same step with a local scatter into the padded slots and a gather back
            local = Local(E, slots)

            def local_moe(x, ids, w, m):
                ex, _, c = local.dispatch(x, None, ids, m, w)
                return local.combine(c, ids, w, between(ex), m)
            xla_fns = stack_fns(lambda p, x: local_moe(x, p[0], p[1], dev_in[4]), args.layers)
            xla_p = (dev_in[2], dev_in[3]) if form == "scan" else [(dev_in[2][n], dev_in[3][n])
                                                                    for n in range(args.layers)]
            xla = jax.jit(xla_fns[form])
            run = lambda: xla(xla_p, dev_in[0])  # noqa: E731
            got = f32(run())[:m]
            if not relative_error(got, want) < TOL:
                raise SystemExit(f"jax_step.py: the simple form with XLA alone: relative error "
                                 f"{relative_error(got, want):.3g}")
            # the op alone over the same slots, one per layer (a barrier between layers: unrolled, XLA would fuse
            # the layers' ops into one pass), and the bytes it moves (read bf16, write bf16)
            ops = stack_fns(lambda _, x: jax.lax.optimization_barrier(between(x)), args.layers)
            ex0 = put(jnp.ones(a2a.cfg.expert_x_shape(), jnp.bfloat16))
            alone = jax.jit(ops[form])
            bq, _ = timed(lambda: alone(jnp.zeros(args.layers) if form == "scan" else [0] * args.layers, ex0),
                          args, args.layers)
            row.update(between_us=float(np.median(bq)), between_bytes=2 * ex0.size * 2)
        q, s = timed(run, args, args.layers)
        row.update(xla_only_per_layer_us=float(np.median(q)), xla_only_step_us=float(np.median(s)))
        rows.append(row)
    if ctx.bench:
        rows_graph = graph_times(ctx.bench, a2a, fp8, args.layers, slots_y=scale is not None)
        for row in rows:
            row.update(rows_graph)
    a2a.destroy()
    return rows


def moe_rows(ctx, dtype, train):
    """The moe rows (a whole layer), or with ``train`` the training step's."""
    comm, put, args, sh = ctx.comm, ctx.put, ctx.args, ctx.shapes
    import moecomm.jax as mj
    W, r = comm.world_size, comm.rank
    if W != 1:
        raise SystemExit("jax_step.py: the moe and train layers are checked at world size 1 (numpy's reference "
                         "of one rank); run them with -np 1")
    T, E, K, H, F = sh
    fp8 = dtype == "float8_e4m3fn"
    capacity = 2 * T * K // E  # twice the mean (world size 1)
    a2a = moecomm.AllToAll(comm, T, E, K, H, sh.scales if fp8 else None, dtype, "bfloat16", capacity=capacity,
                           overflow="drop", gradients=train)
    layer = mj.AllToAll(a2a)
    rng = np.random.default_rng([r, 11])
    params = {k: put(v) for k, v in init_params(rng, sh, args.layers, E).items()}
    x0 = put(rng.standard_normal((T, H)).astype(moecomm.bfloat16))
    m_dev = put(np.array([T], np.int32))
    kind = "train" if train else "moe"

    def block_for(exchange):
        return lambda p, x, m, probe=None: moe_block(p, x, m, exchange, fp8, K, probe)
    ours, local = block_for(Moecomm(layer)), block_for(Local(E, capacity))
    rows = []
    for form in args.forms:
        row = dict(layer=kind, config="r1-decode", world=W, form=form, dtype=dtype, layers=args.layers, ffn=F,
                   capacity=capacity)
        if train:
            step, xla = train_step(ours, form, args.layers), train_step(local, form, args.layers)
            row["checked"] = check_train(ours, local, params, put, capacity, sh, form, rng)
            state = {"p": copy_params(params, form, args.layers)}

            def run():
                loss, state["p"] = step(state["p"], x0, m_dev)
                return loss
            xstate = {"p": copy_params(params, form, args.layers)}

            def xrun():
                loss, xstate["p"] = xla(xstate["p"], x0, m_dev)
                return loss
        else:
            row["checked_tokens"] = check_moe(ours, params, sh, fp8, capacity, put, rng, form,
                                              args.layers)
            fns = stack_fns(lambda p, x: ours(p, x, m_dev), args.layers)
            xfns = stack_fns(lambda p, x: local(p, x, m_dev), args.layers)
            p_of = per_layer(params, args.layers) if form == "unrolled" else params
            step, xla = jax.jit(fns[form]), jax.jit(xfns[form])
            run = lambda: step(p_of, x0)  # noqa: E731
            xrun = lambda: xla(p_of, x0)  # noqa: E731
        layer.check()
        row.update(row_times(run, args, args.layers, [layer]))
        layer.check()
        q, s = timed(xrun, args, args.layers)
        row.update(xla_only_per_layer_us=float(np.median(q)), xla_only_step_us=float(np.median(s)))
        rows.append(row)
    if ctx.bench:
        g = graph_times(ctx.bench, a2a, fp8, args.layers, backward=train, slots_y=True)
        for row in rows:
            row.update(g)
    a2a.destroy()
    return rows


def copy_params(params, form, layers):
    """A fresh copy of the parameters in the form's layout (the training step donates them)."""
    p = {k: jnp.array(v, copy=True) for k, v in params.items()}
    return per_layer(p, layers) if form == "unrolled" else p


def loss_of(block_for, form, layers):
    """The training loss over a stack: mean square of the output rows below m, each layer checkpointed."""
    def loss(params, x, m):
        fns = stack_fns(jax.checkpoint(lambda p, c: block_for(p, c, m)), layers)
        out = fns[form](params, x).astype(jnp.float32)
        rows = (jnp.arange(x.shape[0]) < m[0])[:, None]
        return jnp.sum(jnp.where(rows, out * out, 0)) / (m[0] * x.shape[1])
    return loss


def train_step(block_for, form, layers, lr=1e-3):
    """One SGD step, the parameters donated: (loss, new parameters)."""
    loss = loss_of(block_for, form, layers)

    def step(params, x, m):
        value, grads = jax.value_and_grad(loss)(params, x, m)
        new = jax.tree_util.tree_map(lambda p, g: (p.astype(jnp.float32) - lr * g.astype(jnp.float32)).astype(
            p.dtype), params, grads)
        return value, new
    return jax.jit(step, donate_argnums=0)


def check_train(ours, local, params, put, capacity, sh, form, rng):
    """The loss and every gradient of a one-layer stack, moecomm against XLA alone, at an m where no expert
    overflows (``capacity``); returns the number of arrays compared."""
    T, E, K, H, F = sh
    m = put(np.array([max(1, capacity * E // (8 * K))], np.int32))
    one = {k: v[:1] for k, v in params.items()}
    p = per_layer(one, 1) if form == "unrolled" else one
    x = put(rng.standard_normal((T, H)).astype(moecomm.bfloat16))
    got = jax.jit(jax.value_and_grad(loss_of(ours, form, 1)))(p, x, m)
    want = jax.jit(jax.value_and_grad(loss_of(local, form, 1)))(p, x, m)
    leaves = list(zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)))
    for n, (a, b) in enumerate(leaves):
        err = relative_error(a, b)
        if not err < TOL:
            raise SystemExit(f"jax_step.py: train {form}: the loss or a gradient (leaf {n} of "
                             f"{len(leaves)}) differs from XLA alone's by {err:.3g}")
    return len(leaves)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layer", default="exchange,simple,moe,train",
                   help="comma list of exchange, simple, moe, train: the layers to run (default: all)")
    p.add_argument("--layers", type=int, default=8, help="layers in a step (default 8)")
    p.add_argument("--steps", type=int, default=200, help="steps queued back to back per round (default 200)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds; medians over them (default 5)")
    p.add_argument("--dtypes", default="bfloat16,float8_e4m3fn",
                   help="comma list of bfloat16, float8_e4m3fn: the tokens' dtype (train: bfloat16 only)")
    p.add_argument("--forms", default="unrolled,scan", help="comma list of unrolled, scan: the stack's form")
    p.add_argument("--ffn", type=int, default=R1_DECODE.ffn, help="an expert's inner width (moe, train)")
    p.add_argument("--small", action="store_true", help="small shapes (the capture test's)")
    p.add_argument("--require-captured", action="store_true",
                   help="fail unless handler_runs is 0 in every row (no Python per call in steady state)")
    p.add_argument("--native", action="store_true", help="also time the JAX-native exchange (ragged_all_to_all)")
    p.add_argument("--json", default="jax-step.json", help="output JSON (default jax-step.json)")
    args = p.parse_args()
    args.forms = args.forms.split(",")
    shapes = SMALL if args.small else R1_DECODE._replace(ffn=args.ffn)
    comm = moecomm.init()
    if comm.transport.memory == "host":  # JAX's CPU backend: the checks and handler runs, no graphs
        jax.config.update("jax_platforms", "cpu")
    bench = None if comm.transport.memory == "host" else Bench(comm, SimpleNamespace(delay_us=20.0, warmup=20,
                                                                                     iters=300))
    dev = jax.devices()[min(max(comm.device, 0), len(jax.devices()) - 1)]
    put = lambda a: jax.device_put(a, dev)  # noqa: E731
    ctx = Ctx(comm, put, bench, args, shapes)
    rows = []
    for kind in args.layer.split(","):
        for dtype in args.dtypes.split(","):
            if kind in ("simple", "train") and dtype != "bfloat16":
                continue
            if kind in ("exchange", "simple"):
                rows += exchange_rows(ctx, dtype, None if kind == "exchange" else 2.0)
            else:
                rows += moe_rows(ctx, dtype, kind == "train")
            if comm.rank == 0:
                print_rows(rows[-len(args.forms):])
                write(args, comm, shapes, rows)  # so far: a run cut short keeps what it measured
    if args.native:
        native = native_time(put, dev, args, shapes)
        for row in rows:
            if row["layer"] == "exchange":
                row.update(native)
    if comm.rank == 0:
        print_rows(rows, header=True)
        write(args, comm, shapes, rows)
    uncaptured = [f"{r['layer']} {r['dtype']} {r['form']}: {r['handler_runs']}" for r in rows if r["handler_runs"]]
    comm.finalize()
    if args.require_captured and uncaptured:
        raise SystemExit("jax_step.py: handler runs in the timed steps (Python per call): " + "; ".join(uncaptured))


def write(args, comm, shapes, rows):
    """The JSON: command, machine and versions, shapes, rows."""
    argv = [a for i, a in enumerate(sys.argv[1:]) if a != "--json" and sys.argv[i] != "--json"]
    result = {"command": " ".join([f"mpirun -np {comm.world_size} python tools/jax_step.py", *argv]),
              "environment": dict(environment(), jax=jax.__version__, xla_flags=os.environ.get("XLA_FLAGS", ""),
                                  preallocate=os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "")),
              "shapes": shapes._asdict(), "results": rows}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


def print_rows(rows, header=False):
    cols = ("per_layer_us", "step_us", "graph_us", "xla_only_per_layer_us", "between_us")
    if header:
        print(f"{'layer':<9}{'dtype':<14}{'form':<10}" + "".join(f"{c[:-3]:>22}" for c in cols) + "  handler runs")
    for row in rows:
        print(f"{row['layer']:<9}{row['dtype']:<14}{row['form']:<10}"
              + "".join(f"{row.get(c, float('nan')):>20.1f}us" for c in cols)
              + f"  {row['handler_runs']} / {row['timed_steps']}", flush=True)


def native_time(put, dev, args, shapes):
    """Median µs per layer of the exchange the JAX-native way (one device; sort the pairs by expert,
    ``lax.ragged_all_to_all`` there and back, a weighted scatter-add), its output checked against numpy, and
    of the same layer without its two exchanges."""
    return dict(native_per_layer_us=native_layer_time(put, dev, args, shapes, True),
                native_without_exchange_us=native_layer_time(put, dev, args, shapes, False))


def native_layer_time(put, dev, args, shapes, exchange):
    from jax.sharding import Mesh, PartitionSpec as P
    try:
        from jax import shard_map
    except ImportError:
        from jax.experimental.shard_map import shard_map
    T, E, K, H, _ = shapes
    mesh = Mesh(np.array([dev]), ("ep",))
    n = T * K

    def layer(x, ids, w):  # one device: the exchange there and back is with itself
        flat = ids.reshape(-1)
        order = jnp.argsort(flat)
        tok = order // K
        rows = x[tok]
        zero = jnp.zeros((1,), jnp.int32)
        size = jnp.full((1,), n, jnp.int32)
        back = rows
        if exchange:
            there = jax.lax.ragged_all_to_all(rows, jnp.zeros_like(rows), zero, size, zero, size, axis_name="ep")
            back = jax.lax.ragged_all_to_all(there, jnp.zeros_like(rows), zero, size, zero, size, axis_name="ep")
        weighted = back.astype(jnp.float32) * w.reshape(-1)[order][:, None]
        return jnp.zeros((T, H), jnp.float32).at[tok].add(weighted).astype(jnp.bfloat16)

    def stack(x, ids, w):
        return jax.lax.scan(lambda c, p: (layer(c, p[0], p[1]), None), x, (ids, w))[0]
    spec = P()
    step = jax.jit(shard_map(stack, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec))
    rng = np.random.default_rng(3)
    x = rng.standard_normal((T, H), np.float32).astype(moecomm.bfloat16)
    ids = np.stack([np.argsort(rng.random((T, E)), 1)[:, :K] for _ in range(args.layers)]).astype(np.int32)
    w = (rng.random((args.layers, T, K), np.float32) / K).astype(np.float32)
    got = f32(step(put(x), put(ids), put(w)))
    want = f32(x)
    for lay in range(args.layers):
        want = f32((want * w[lay].sum(1, keepdims=True)).astype(moecomm.bfloat16))
    err = relative_error(got, want)
    if not err < TOL:
        raise SystemExit(f"jax_step.py: the JAX-native layer: relative error {err:.3g} against numpy")
    args_dev = (put(x), put(ids), put(w))
    for _ in range(5):
        out = step(*args_dev)
    out.block_until_ready()
    per = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for _ in range(20):
            out = step(*args_dev)
        out.block_until_ready()
        per.append(1e6 * (time.perf_counter() - t0) / (20 * args.layers))
    return float(np.median(per))


if __name__ == "__main__":
    main()
