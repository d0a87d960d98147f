"""moecomm.jax where real programs call it, checked against the same layers in plain JAX on one device:

    mpiexec -n 2 python tests/mpi_jax.py            # host transport, JAX's CPU backend
    mpirun -np 2 python tests/mpi_jax.py            # GPUs (ranks may share one: MOECOMM_TRANSPORT=ipc)

The layer: router top-k -> dispatch -> every local expert as one batched matmul over its slots -> combine.
Each case runs jitted with a new token count m < max_num_tokens (and m = max_num_tokens once), on fresh
random tokens, and compares rows < m with the reference (relative L2, bf16 tolerance); rows >= m must be zeros:

* one layer, router weights sent with dispatch or given at combine; two AllToAlls in one jitted step;
* ``lax.scan`` over two layers (unroll 1 and 2), ``fori_loop``, ``while_loop``, ``lax.cond`` and ``lax.switch``
  around a layer, ``jax.vmap`` refused with a moecomm error,
  ``jax.checkpoint``, a donated input, split halves with other work between them inside a scan, a scan whose
  per-layer outputs are also returned (XLA may then compute a pure operation twice), m changing every step
  under one compiled program.

Stacked layers are compared two ways. With routing that does not depend on the activations (ids and weights
per layer, drawn at random), end to end. With the router in the loop, layer by layer: the reference applies
layer l to moecomm's input of layer l, since a router re-routes rounding differences through top-k (see
moecomm/jax.py). Prints "<n> checks on <w> ranks: <f> failures".
"""
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # ranks may share one GPU

import numpy as np  # noqa: E402

import moecomm  # noqa: E402
from report import finish  # noqa: E402

M, H, EL, K, LAYERS, TOL = 32, 64, 4, 2, 2, 2e-2


def main():
    comm = moecomm.init()
    import jax
    import jax.numpy as jnp

    import jax_layers
    import moecomm.jax as mj
    from jax_layers import experts, reference as ref
    if comm.transport.memory == "host":
        jax.config.update("jax_platforms", "cpu")
    W, r = comm.world_size, comm.rank
    E = EL * W
    dev = jax.devices()[min(comm.device, len(jax.devices()) - 1)] if comm.device >= 0 else jax.devices("cpu")[0]
    a2a = moecomm.AllToAll(comm, M, E, K, H, None, "bfloat16", "bfloat16")
    other = moecomm.AllToAll(comm, M, E, K, H, None, "bfloat16", "bfloat16")
    layer, layer2 = mj.AllToAll(a2a), mj.AllToAll(other)
    keys = jax.random.split(jax.random.PRNGKey(7), 3)  # every rank draws the same weights
    put = lambda a: jax.device_put(a, dev)  # noqa: E731
    w_router = put(jax.random.normal(keys[0], (LAYERS, H, E)) / H ** 0.5)
    w_experts = put((jax.random.normal(keys[1], (LAYERS, E, H, H)) / H ** 0.5).astype(jnp.bfloat16))
    w_local = w_experts[:, r * EL:(r + 1) * EL]

    def route(x, w):
        return jax_layers.route(x, w, K)

    def moe(lay, x, m, ids, wts, w, at_combine=False):
        _, ex, _ = lay.dispatch(x, None, ids, m, None if at_combine else wts)
        return lay.combine(ids, wts if at_combine else None, experts(ex, w), m)

    def moe_split(x, m, ids, wts, w):
        sent = layer.dispatch_send(x, None, ids, m, wts)
        side = jnp.tanh(x.astype(jnp.float32)) @ jnp.ones((H, H), jnp.float32)  # work while tokens fly
        _, ex, _ = layer.dispatch_recv(sent)
        back = layer.combine_send(ids, None, experts(ex, w), m)
        return layer.combine_recv(back), side

    def layer_l(x, m, n, lay=layer, at_combine=False):  # layer n, routed from its input
        return moe(lay, x, m, *route(x, w_router[n]), w_local[n], at_combine)

    def ref_l(x, n):
        return ref(x, *route(x, w_router[n]), w_experts[n])

    def scan_stack(x, m, unroll=1):  # per-layer outputs returned too: each combine feeds carry and ys
        def body(c, n):
            o = layer_l(c, m, n)
            return o, o
        return jax.lax.scan(body, x, jnp.arange(LAYERS), unroll=unroll)

    def fixed_scan(x, m, ids, wts):  # routing per layer given (activation-independent)
        return jax.lax.scan(lambda c, p: (moe(layer, c, m, p[0], p[1], w_local[p[2]]), None), x,
                            (ids, wts, jnp.arange(LAYERS)))[0]

    def fixed_fori(x, m, ids, wts):
        return jax.lax.fori_loop(0, LAYERS, lambda n, c: moe(layer, c, m, ids[n], wts[n], w_local[n]), x)

    def fixed_ref(x, ids, wts):
        return jax.lax.scan(lambda c, p: (ref(c, p[0], p[1], w_experts[p[2]]), None), x,
                            (ids, wts, jnp.arange(LAYERS)))[0]

    def split_scan(x, m, ids, wts):
        def body(c, p):
            o, side = moe_split(c, m, p[0], p[1], w_local[p[2]])
            return o, side.sum()
        return jax.lax.scan(body, x, (ids, wts, jnp.arange(LAYERS)))[0]

    def two(x, m):  # two AllToAlls in one step
        return layer_l(layer_l(x, m, 0), m, 1, lay=layer2, at_combine=True)

    cases = {  # name: (jitted, reference of one step)
        "jit": (jax.jit(lambda x, m: layer_l(x, m, 0)), lambda x: ref_l(x, 0)),
        "weights at combine": (jax.jit(lambda x, m: layer_l(x, m, 0, at_combine=True)), lambda x: ref_l(x, 0)),
        "checkpoint": (jax.jit(jax.checkpoint(lambda x, m: layer_l(x, m, 0))), lambda x: ref_l(x, 0)),
        "donated input": (jax.jit(lambda x, m: layer_l(x, m, 0), donate_argnums=0), lambda x: ref_l(x, 0)),
        "cond true": (jax.jit(lambda x, m: jax.lax.cond(m[0] > 0, lambda v: layer_l(v, m, 0), lambda v: v * 2, x)),
                      lambda x: ref_l(x, 0)),
        "cond false": (jax.jit(lambda x, m: jax.lax.cond(m[0] < 0, lambda v: layer_l(v, m, 0), lambda v: v * 2, x)),
                       lambda x: x * 2),
        "switch": (jax.jit(lambda x, m: jax.lax.switch(m[0] % 2, [lambda v: layer_l(v, m, 0)] * 2, x)),
                   lambda x: ref_l(x, 0)),
        "while_loop": (jax.jit(lambda x, m: jax.lax.while_loop(
            lambda c: c[1] < 1, lambda c: (layer_l(c[0], m, 0), c[1] + 1), (x, 0))[0]), lambda x: ref_l(x, 0)),
    }
    stacks = {  # name: (jitted, its reference), routing given
        "scan, routing given, end to end": (jax.jit(fixed_scan), fixed_ref),
        "fori_loop, routing given, end to end": (jax.jit(fixed_fori), fixed_ref),
        "split halves and other work in a scan": (jax.jit(split_scan), fixed_ref),
    }
    scans = {u: jax.jit(lambda x, m, u=u: scan_stack(x, m, u)) for u in (1, 2)}
    two_step = jax.jit(two)
    fails, checks = [], 0

    def close(name, got, want, m):
        nonlocal checks
        checks += 1
        got = np.asarray(got)
        err = jax_layers.relative_error(got[:m], np.asarray(want)[:m])
        if not err < TOL:  # NaN fails
            fails.append(f"rank {r}: {name} m={m}: relative error {err:.3g}")
        if name != "cond false" and np.any(got[m:].astype(np.float32) != 0):  # a combine's rows >= m: zeros
            fails.append(f"rank {r}: {name} m={m}: rows >= m are not zeros")

    rng = np.random.default_rng([r, 11])
    for m in [int(v) for v in rng.integers(1, M, 3)] + [M]:  # m changes every step, programs stay compiled
        x = put(jnp.asarray(rng.standard_normal((M, H)), jnp.bfloat16))
        bound = put(jnp.asarray([m], jnp.int32))
        ids = jnp.asarray(np.stack([np.argsort(rng.random((M, E)), 1)[:, :K] for _ in range(LAYERS)]), jnp.int32)
        wts = jnp.asarray(rng.random((LAYERS, M, K)), jnp.float32)
        try:
            for name, (fn, want) in cases.items():
                close(name, fn(jnp.array(x) if name == "donated input" else x, bound), want(x), m)
            for name, (fn, want) in stacks.items():
                close(name, fn(x, bound, put(ids), put(wts)), want(x, ids, wts), m)
            for u, fn in scans.items():  # router in the loop: layer by layer, on moecomm's input of each layer
                out, ys = fn(x, bound)
                close(f"scan unroll={u}: carry is the last layer's output", out, ys[-1], m)
                for lay in range(LAYERS):
                    close(f"scan unroll={u}, layer {lay} on its input", ys[lay], ref_l(x if lay == 0 else ys[lay - 1],
                                                                                    lay), m)
            h = two_step(x, bound)
            close("two AllToAlls in one step (layer 1 on moecomm's layer 0)", h,
                  ref_l(cases["jit"][0](x, bound), 1), m)
        except Exception as e:  # noqa: BLE001 - JAX wraps callback errors in its own
            checks += 1
            fails.append(f"rank {r}: m={m}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    checks += 1  # jax.vmap over a layer: refused with what to do instead
    try:
        jax.vmap(lambda v: layer_l(v, put(jnp.asarray([M], jnp.int32)), 0))(jnp.stack([x, x]))
        fails.append(f"rank {r}: jax.vmap over a layer was not refused")
    except moecomm.InvalidArgument as e:
        if "vmap" not in str(e):
            fails.append(f"rank {r}: jax.vmap refused without saying why: {e}")
    a2a.check()  # errors the GPU recorded in calls replayed from command buffers
    other.check()
    a2a.synchronize()
    other.synchronize()
    a2a.destroy()
    other.destroy()
    finish(comm, fails, checks)


if __name__ == "__main__":
    sys.exit(main())
