"""Gradients through moecomm.jax against the same layers in plain JAX with every expert on one device:

    mpiexec -n 2 python tests/mpi_jax_grad.py [--transport host|ipc|nvshmem]   # host: JAX's CPU backend

The layer: router top-k -> dispatch -> each local expert one matmul over its slots -> combine. Every rank's
loss is its own tokens' (rows < m, m drawn per rank and step); ``jax.grad`` of it on each rank gives, through
moecomm's backward, the gradient of the sum of every rank's loss for the tokens (its own), the local experts'
weights (every rank's tokens reach them) and the router (its own tokens' routing). The reference computes the
same sum in plain JAX from every rank's inputs (each rank draws them all) and differentiates it. Cases: one
layer jitted, router weights at combine and sent with dispatch, under ``jax.checkpoint``, eagerly (no jit);
two layers under ``lax.scan`` with routing given per layer (weights differentiated too) and with the router in
the loop (scan of two layers whose routing is drawn from their input), each layer also under ``jax.checkpoint``
inside the scan; the experts' weights alone (dispatch's inputs not differentiated) with zero_slots. Relative L2
error below 2e-2 (bf16).
Prints "<n> checks on <w> ranks: <f> failures".
"""
import argparse

import numpy as np

import moecomm
from report import finish

M, H, EL, K, LAYERS, TOL = 16, 32, 3, 2, 2, 2e-2


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--transport", default="host")
    comm = moecomm.init(transport=p.parse_args().transport)
    import jax
    import jax.numpy as jnp

    import jax_layers
    import moecomm.jax as mj
    from jax_layers import experts, reference as ref
    if comm.transport.memory == "host":
        jax.config.update("jax_platforms", "cpu")
    W, r = comm.world_size, comm.rank
    E = EL * W
    a2a = moecomm.AllToAll(comm, M, E, K, H, None, "bfloat16", "bfloat16", gradients=True)
    layer, zeroed = mj.AllToAll(a2a), mj.AllToAll(a2a, zero_slots=True)
    keys = jax.random.split(jax.random.PRNGKey(3), 2)  # every rank draws the same parameters
    w_router = jax.random.normal(keys[0], (LAYERS, H, E)) / H ** 0.5
    w_experts = (jax.random.normal(keys[1], (LAYERS, E, H, H)) / H ** 0.5).astype(jnp.bfloat16)
    mine = slice(r * EL, (r + 1) * EL)

    def route(x, w):
        return jax_layers.route(x, w, K)

    def moe(x, m, ids, wts, w_local, at_combine, lay=layer):
        _, ex, _ = lay.dispatch(x, None, ids, m, None if at_combine else wts)
        return lay.combine(ids, wts, experts(ex, w_local), m)  # sent with dispatch: summed on the expert side

    def loss(out, m, target):
        o = out.astype(jnp.float32) * (jnp.arange(M) < m[0])[:, None]
        return (o * target).sum() + 0.1 * (o * o).sum()

    def one_layer(at_combine):
        def f(x, wr, we, m, target):
            return loss(moe(x, m, *route(x, wr[0]), we[0], at_combine), m, target)

        def f_ref(x, wr, we_all, m, target):
            return loss(ref(x, *route(x, wr[0]), we_all[0]), m, target)
        return f, f_ref

    def given_stack(x, wr, we, m, target, ids, wts):  # routing per layer given; wts differentiated
        def body(c, p):
            return moe(c, m, p[0], p[1], we[p[2]], False), None
        return loss(jax.lax.scan(body, x, (ids, wts, jnp.arange(LAYERS)))[0], m, target)

    def given_stack_ref(x, wr, we_all, m, target, ids, wts):
        def body(c, p):
            return ref(c, p[0], p[1], we_all[p[2]]), None
        return loss(jax.lax.scan(body, x, (ids, wts, jnp.arange(LAYERS)))[0], m, target)

    def routed_stack(x, wr, we, m, target):  # the router in the loop
        def body(c, n):
            return moe(c, m, *route(c, wr[n]), we[n], True), None
        return loss(jax.lax.scan(body, x, jnp.arange(LAYERS))[0], m, target)

    def remat_stack(x, wr, we, m, target):  # jax.checkpoint around each layer of the scanned stack
        @jax.checkpoint
        def layer_n(c, n):
            return moe(c, m, *route(c, wr[n]), we[n], True)
        return loss(jax.lax.scan(lambda c, n: (layer_n(c, n), None), x, jnp.arange(LAYERS))[0], m, target)

    def routed_stack_ref(x, wr, we_all, m, target):
        def body(c, n):
            return ref(c, *route(c, wr[n]), we_all[n]), None
        return loss(jax.lax.scan(body, x, jnp.arange(LAYERS))[0], m, target)

    def experts_only(x, wr, we, m, target, ids, wts):  # dispatch's inputs not differentiated: zero_slots
        return loss(moe(x, m, ids[0], wts[0], we[0], True, lay=zeroed), m, target)

    def experts_only_ref(x, wr, we_all, m, target, ids, wts):
        return loss(ref(x, ids[0], wts[0], we_all[0]), m, target)

    f_combine, ref_combine = one_layer(True)
    f_dispatch, ref_dispatch = one_layer(False)
    cases = {  # name: (moecomm loss of this rank, its plain reference, whether routing is given)
        "one layer, weights at combine": (jax.jit(f_combine), ref_combine, False),
        "one layer, weights sent with dispatch": (jax.jit(f_dispatch), ref_dispatch, False),
        "one layer under jax.checkpoint": (jax.jit(jax.checkpoint(f_dispatch)), ref_dispatch, False),
        "one layer, eager": (f_combine, ref_combine, False),
        "lax.scan of two layers, routing given": (jax.jit(given_stack), given_stack_ref, True),
        "lax.scan of two layers, router in the loop": (jax.jit(routed_stack), routed_stack_ref, False),
        "lax.scan of two checkpointed layers": (jax.jit(remat_stack), routed_stack_ref, False),
        "the experts' weights only, zero_slots": (jax.jit(experts_only), experts_only_ref, "experts"),
    }
    fails, checks = [], 0

    def close(name, got, want):
        nonlocal checks
        checks += 1
        err = jax_layers.relative_error(got, want)
        if not err < TOL:  # NaN fails
            fails.append(f"rank {r}: {name}: relative error {err:.3g}")

    for step in range(2):
        inputs = []  # every rank's, drawn by every rank
        for q in range(W):
            rng = np.random.default_rng([q, step])
            m = M if step == 1 and q == 0 else int(rng.integers(1, M))
            x = jnp.asarray(rng.standard_normal((M, H)), jnp.bfloat16)
            ids = jnp.asarray(np.stack([np.argsort(rng.random((M, E)), 1)[:, :K] for _ in range(LAYERS)]), jnp.int32)
            wts = jnp.asarray(rng.random((LAYERS, M, K)), jnp.float32)
            inputs.append((x, jnp.asarray([m], jnp.int32), jnp.asarray(rng.standard_normal((M, H)), jnp.float32),
                           ids, wts))
        for name, (f, f_ref, given) in cases.items():
            x, m, target, ids, wts = inputs[r]
            extra = (ids, wts) if given else ()
            argnums = (2,) if given == "experts" else (0, 1, 2, 6) if given else (0, 1, 2)
            got = jax.grad(f, argnums)(x, w_router, w_experts[:, mine], m, target, *extra)

            def total(xs, wr, we_all, wts_all):
                return sum(f_ref(xs[q], wr, we_all, inputs[q][1], inputs[q][2],
                                 *((inputs[q][3], wts_all[q]) if given else ())) for q in range(W))
            xs, wts_all = [i[0] for i in inputs], [i[4] for i in inputs]
            want_x, _, want_we, want_wts = jax.grad(total, (0, 1, 2, 3))(xs, w_router, w_experts, wts_all)
            if given == "experts":
                close(f"{name}: d/d local experts", got[0], want_we[:, mine])
                continue
            want_wr = jax.grad(f_ref, 1)(x, w_router, w_experts, m, target, *extra)  # its own tokens' routing
            close(f"{name}: d/d tokens", got[0], want_x[r])
            close(f"{name}: d/d router", got[1], want_wr)
            close(f"{name}: d/d local experts", got[2], want_we[:, mine])
            if given:
                close(f"{name}: d/d router weights", got[3], want_wts[r])
    a2a.destroy()
    finish(comm, fails, checks)


if __name__ == "__main__":
    main()
