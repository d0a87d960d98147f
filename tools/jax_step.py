"""A jitted JAX step of MoE layers through moecomm.jax against the same kernels in a CUDA graph and the
JAX-native exchange, R1-decode shapes (128 tokens, 7168 hidden, 256 experts, top-8), one GPU per rank.

    mpirun -np 1 python tools/jax_step.py [--layers 8] [--steps 200] [--json jax-step.json]

Each layer: dispatch (router weights sent with it) -> the experts -> combine, its routing given as data (ids
and weights per layer, drawn at random), so that stacks compare end to end. The experts are left out of the
measurement: in bfloat16 the identity (combine reads dispatch's output), in FP8 (e4m3 tokens with 56 float32
scales) a fixed bfloat16 output per expert (one value per expert, so the result does not depend on the slot
order), with combine's bound_m computed from dispatch's counts (XLA orders the calls by data alone: an
optimization barrier is no dependency once XLA removes it, and a combine that read nothing of its dispatch
ran before it); the next layer's tokens are the combined ones
(as e4m3 with the same scales in FP8). Forms: ``unrolled`` (a Python loop in the jitted function) and
``scan`` (``lax.scan`` over the layers). Every form is checked first against moecomm.reference on fresh
random tokens, routing and m, layer after layer with the kernels' rounding (float32 sums, bfloat16 results),
and again with another m on the same compiled step (a stale capture of the first m would fail it).

Timed (medians over ``--rounds`` rounds): ``per_layer_us``, ``--steps`` steps queued back to back then waited
for, per layer; ``step_us``, one step at a time (dispatch, wait); ``graph_us``, dispatch + combine of one
layer captured in a CUDA graph with moecomm's kernels alone, timed as moecomm.bench times graphs (a device
delay first, CUDA events); ``graph_step_us``, the layers' calls in one CUDA graph launched and waited for one
at a time; ``xla_only_per_layer_us`` and ``xla_only_step_us``, the same step with each layer's
calls replaced by one fused XLA op (the floor JAX and XLA set); ``native_per_layer_us``, the same layer the
JAX-native way: sort the (token, expert) pairs by expert, ``lax.ragged_all_to_all`` under ``shard_map`` there
and back, a weighted scatter-add. ``handler_runs`` counts how often moecomm's handlers ran in the timed steps
(0: XLA replayed its command buffers with no Python).
Prints a table; writes the JSON (command, GPU, versions, rows).
"""
import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # CuPy and JAX share the GPU

import numpy as np  # noqa: E402

import moecomm  # noqa: E402
from moecomm import reference  # noqa: E402
from moecomm.bench import Bench, environment, stats  # noqa: E402

T, E, K, H, S = 128, 256, 8, 7168, 56  # R1-decode: tokens per rank, experts, top-k, hidden, scales per token


def draw(rng, W, layers, m):
    """Every rank's inputs of one step (every rank draws them all): tokens, scales, ids and weights per layer."""
    x = [rng.standard_normal((T, H), np.float32).astype(moecomm.bfloat16) for _ in range(W)]
    xs = [(rng.random((T, S), np.float32) + 0.5).astype(np.float32) for _ in range(W)]
    ids = [np.stack([np.argsort(rng.random((T, E)), 1)[:, :K] for _ in range(layers)]).astype(np.int32)
           for _ in range(W)]
    w = [(rng.random((layers, T, K), np.float32) / K).astype(np.float32) for _ in range(W)]
    return x, xs, ids, w, m


def reference_stack(inputs, fp8, layers, rank, W, y_expert):
    """This rank's output of the stack, layer after layer with the kernels' rounding."""
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
            y = [r["expert_x"] for r in ref]
        cur = reference.combine([i[n][:m] for i in ids], [wi[n][:m] for wi in w], y, [r["origin"] for r in ref], E,
                                W, moecomm.bfloat16)
    return cur[rank]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=200, help="steps queued back to back per round (default 200)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtypes", default="bfloat16,float8_e4m3fn")
    p.add_argument("--forms", default="unrolled,scan")
    p.add_argument("--no-native", dest="native", action="store_false", help="leave out the JAX-native layer")
    p.add_argument("--json", default="jax-step.json")
    args = p.parse_args()
    comm = moecomm.init()
    import jax
    import jax.numpy as jnp

    import moecomm.jax as mj
    W, r = comm.world_size, comm.rank
    dev = jax.devices()[min(comm.device, len(jax.devices()) - 1)]
    put = lambda a: jax.device_put(a, dev)  # noqa: E731
    L = E // W
    y_expert = (np.arange(E, dtype=np.float32) % 17 / 16 + 0.25).astype(moecomm.bfloat16)[:, None]  # [E, 1]
    bench = Bench(comm, SimpleNamespace(delay_us=20.0, warmup=20, iters=300))
    rows = []
    for dtype in args.dtypes.split(","):
        fp8 = dtype == "float8_e4m3fn"
        a2a = moecomm.AllToAll(comm, T, E, K, H, S if fp8 else None, dtype, "bfloat16")
        layer = mj.AllToAll(a2a)
        slots = a2a.cfg.expert_x_shape()[1]
        y_local = put(jnp.broadcast_to(jnp.asarray(y_expert[r * L:(r + 1) * L, :, None] * np.ones((1, 1, H)),
                                                   jnp.bfloat16), (L, slots, H)))

        def moe(x, xs, ids, w, m):
            counts, ex, _ = layer.dispatch(x.astype(dtype) if fp8 else x, xs if fp8 else None, ids, m, w)
            if fp8:  # m itself (counts >= 0), after the dispatch
                return layer.combine(ids, None, y_local, jnp.where(counts[:1] < 0, 0, m))
            return layer.combine(ids, None, ex, m)

        def unrolled(x, xs, ids, w, m):
            for n in range(args.layers):
                x = moe(x, xs, ids[n], w[n], m)
            return x

        def scanned(x, xs, ids, w, m):
            return jax.lax.scan(lambda c, p: (moe(c, xs, p[0], p[1], m), None), x, (ids, w))[0]
        forms = {"unrolled": unrolled, "scan": scanned}
        for form in args.forms.split(","):
            step = jax.jit(forms[form])
            rng = np.random.default_rng([r, 5])
            for m in (T - 17, T):  # the second on the same compiled step: no stale capture of the first
                inputs = draw(rng, W, args.layers, m)
                dev_in = [put(a[r]) for a in inputs[:4]] + [put(np.array([m], np.int32))]
                got = np.asarray(step(*dev_in), np.float32)[:m]
                want = reference_stack(inputs, fp8, args.layers, r, W, y_expert).astype(np.float32)
                err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
                if not err < 2e-2:
                    raise SystemExit(f"jax_step.py: {dtype} {form}, m={m}: relative error {err:.3g} against "
                                     f"moecomm.reference")
            layer.check()
            runs = {"n": 0}
            for name in ("_dispatch", "_combine"):  # how often the handlers run in the timed steps
                fn = getattr(layer, name)
                setattr(layer, name, lambda *a, fn=fn: (runs.__setitem__("n", runs["n"] + 1), fn(*a))[1])
            for _ in range(20):  # XLA runs a step's first executions op by op before its command buffers
                out = step(*dev_in)
            out.block_until_ready()
            runs["n"] = 0
            queued, single = timed(step, args, dev_in)
            handler_runs = runs["n"]
            del layer._dispatch, layer._combine
            layer.check()
            rows.append(dict(config="r1-decode", world=W, form=form, dtype=dtype, layers=args.layers,
                             per_layer_us=float(np.median(queued)), per_layer_spread_us=[min(queued), max(queued)],
                             step_us=float(np.median(single)), step_p99_us=float(np.percentile(single, 99)),
                             handler_runs=handler_runs, timed_steps=20 + args.rounds * (args.steps + 20)))
        graph = graph_time(bench, a2a, comm, fp8, args.layers)
        for row in rows:
            if row["dtype"] == dtype:
                row.update(graph)
                row.update(xla_only_time(jax, jnp, row["form"], args, dev_in))
        a2a.destroy()
    if args.native:
        native = native_time(jax, jnp, put, dev, args)
        for row in rows:
            row.update(native)
    argv = [a for i, a in enumerate(sys.argv[1:]) if a != "--json" and sys.argv[i] != "--json"]
    result = {"command": " ".join([f"mpirun -np {W} python tools/jax_step.py", *argv]),
              "environment": dict(environment(), jax=jax.__version__, xla_flags=os.environ.get("XLA_FLAGS", "")),
              "results": rows}
    if r == 0:
        cols = ("per_layer_us", "step_us", "graph_us", "graph_step_us", "xla_only_per_layer_us", "xla_only_step_us",
                "native_per_layer_us")
        print(f"{'dtype':<14}{'form':<10}" + "".join(f"{c[:-3]:>16}" for c in cols) + "  handler runs")
        for row in rows:
            print(f"{row['dtype']:<14}{row['form']:<10}" + "".join(f"{row.get(c, float('nan')):>14.1f}us" for c in cols)
                  + f"  {row['handler_runs']} / {row['timed_steps']}")
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    comm.finalize()


def timed(step, args, dev_in):
    """(pipelined µs per layer, one step at a time µs) of a jitted step, medians over the rounds."""
    for _ in range(20):
        out = step(*dev_in)
    out.block_until_ready()
    queued, single = [], []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for _ in range(args.steps):
            out = step(*dev_in)
        out.block_until_ready()
        queued.append(1e6 * (time.perf_counter() - t0) / (args.steps * args.layers))
        for _ in range(20):
            t0 = time.perf_counter()
            step(*dev_in).block_until_ready()
            single.append(1e6 * (time.perf_counter() - t0))
    return queued, single


def xla_only_time(jax, jnp, form, args, dev_in):
    """The floor JAX and XLA set without moecomm: the same step (same inputs, form and layer count) with each
    layer's dispatch + combine replaced by one fused XLA op on the tokens (x * the sum of its weights)."""
    def layer(x, w):
        return (x.astype(jnp.float32) * w.sum(1, keepdims=True)).astype(x.dtype)

    def xla_unrolled(x, xs, ids, w, m):
        for n in range(args.layers):
            x = layer(x, w[n])
        return x

    def xla_scanned(x, xs, ids, w, m):
        return jax.lax.scan(lambda c, p: (layer(c, p), None), x, w)[0]
    queued, single = timed(jax.jit(xla_unrolled if form == "unrolled" else xla_scanned), args, dev_in)
    return dict(xla_only_per_layer_us=float(np.median(queued)), xla_only_step_us=float(np.median(single)))


def graph_time(bench, a2a, comm, fp8, layers):
    """Median microseconds of dispatch + combine of one layer in a CUDA graph (moecomm's kernels alone), and of
    a graph of ``layers`` such layers launched and waited for one at a time (the step's floor without JAX)."""
    cp = bench.cp
    rng = np.random.default_rng(9)
    L = a2a.cfg.num_local_experts
    slots = a2a.cfg.expert_x_shape()[1]
    with bench.stream:
        x = cp.asarray(rng.integers(0, 255, (T, H), np.uint8) & 0x77) if fp8 else \
            cp.asarray(rng.standard_normal((T, H), np.float32).astype(moecomm.bfloat16).view(np.uint16))
        d = dict(x=x, xs=cp.asarray(rng.random((T, S), np.float32)) if fp8 else None,
                 idx=cp.asarray(np.argsort(rng.random((T, E)), 1)[:, :K].astype(np.int32)),
                 w=cp.asarray(rng.random((T, K), np.float32)), m=cp.asarray(np.array([T], np.int32)),
                 n=cp.zeros(L, np.int32), ex=cp.zeros((L, slots, H), np.uint8 if fp8 else np.uint16),
                 es=cp.zeros((L, slots, S), np.float32) if fp8 else None,
                 y=cp.full((L, slots, H), 0x3C00, np.uint16), out=cp.zeros((T, H), np.uint16))
        y = d["y"] if fp8 else d["ex"]

        def calls():
            a2a.dispatch(d["n"], d["ex"], d["es"], d["x"], d["xs"], d["idx"], d["m"], weights=d["w"],
                         stream=bench.stream)
            a2a.combine(d["out"], d["idx"], None, y, d["m"], stream=bench.stream)
        calls()
        a2a.synchronize(bench.stream)
        graph = stats(bench.time_graphs([bench.capture(calls)], 0))["median_us"]
        stack = bench.capture(lambda: [calls() for _ in range(layers)])
        single = []
        for _ in range(120):  # launched and waited for from the host, as one jitted step at a time is
            t0 = time.perf_counter()
            stack.launch(bench.stream)
            bench.stream.synchronize()
            single.append(1e6 * (time.perf_counter() - t0))
        return dict(graph_us=graph, graph_step_us=float(np.median(single[20:])))


def native_time(jax, jnp, put, dev, args):
    """Median microseconds per layer of the JAX-native layer (one device), its output checked against numpy;
    and of the same layer without its two exchanges (what the sort, gather and scatter-add cost alone)."""
    return dict(native_per_layer_us=native_layer_time(jax, jnp, put, dev, args, True),
                native_without_exchange_us=native_layer_time(jax, jnp, put, dev, args, False))


def native_layer_time(jax, jnp, put, dev, args, exchange):
    from jax.sharding import Mesh, PartitionSpec as P
    try:
        from jax import shard_map
    except ImportError:
        from jax.experimental.shard_map import shard_map
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
    got = np.asarray(step(put(x), put(ids), put(w)), np.float32)
    want = x.astype(np.float32)
    for lay in range(args.layers):
        want = (want * w[lay].sum(1, keepdims=True)).astype(moecomm.bfloat16).astype(np.float32)
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    if not err < 2e-2:
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
