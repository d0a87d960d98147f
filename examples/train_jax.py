"""Training a 2-layer MoE stack in JAX through moecomm: a few SGD steps on every rank's own tokens, the layers
under lax.scan, the loss falling, and the first step's gradients checked against the same stack computed on
one device in plain JAX.

    mpiexec -n 2 python examples/train_jax.py [--steps 8] [--transport ipc]   # default: host, JAX's CPU backend

Each layer: router (softmax, top-k) -> dispatch (router weights sent with it) -> every local expert as one
batched matmul over its slots -> combine (summed on the expert side; the weights are given to combine too,
which is how their gradient flows). The task: fit a fixed random teacher. Expert weights live on their rank
and take their full gradient there (every rank's tokens reach them through moecomm's backward); the router is
replicated, so its gradient is summed over the ranks. On a GPU transport JAX runs on the GPUs.
"""
import argparse

import numpy as np

import moecomm


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    p.add_argument("--experts-per-rank", type=int, default=2, help="experts on each rank (default 2)")
    p.add_argument("--topk", type=int, default=2, help="experts per token (default 2)")
    p.add_argument("--steps", type=int, default=8, help="steps (default 8)")
    p.add_argument("--lr", type=float, default=0.5, help="SGD learning rate (default 0.5)")
    p.add_argument("--transport", default="host", choices=["host", "ipc", "nvshmem"],
                   help="host (JAX's CPU backend), or a GPU transport")
    args = p.parse_args()

    comm = moecomm.init(transport=args.transport)
    import jax
    import jax.numpy as jnp

    import moecomm.jax as mj
    if comm.transport.memory == "host":
        jax.config.update("jax_platforms", "cpu")
    W, r, M, H, K, LAYERS = comm.world_size, comm.rank, args.tokens, args.hidden, args.topk, 2
    L = args.experts_per_rank
    E = L * W
    layer = mj.AllToAll(moecomm.AllToAll(comm, M, E, K, H, None, "bfloat16", "bfloat16", gradients=True))
    keys = jax.random.split(jax.random.PRNGKey(0), 3)  # the same on every rank
    router = jax.random.normal(keys[0], (LAYERS, H, E)) / H ** 0.5
    experts_all = jax.random.normal(keys[1], (LAYERS, E, H, H)) / H ** 0.5
    teacher = jax.random.normal(keys[2], (H, H)) / H ** 0.5
    experts = experts_all[:, r * L:(r + 1) * L]  # this rank's, float32 master weights

    def data(q):  # rank q's tokens and targets
        x = jax.random.normal(jax.random.PRNGKey(100 + q), (M, H))
        return x.astype(jnp.bfloat16), jnp.tanh(x @ teacher)
    x, target = data(r)
    m = jnp.asarray([M], jnp.int32)

    def route(h, w):
        wts, ids = jax.lax.top_k(jax.nn.softmax(h.astype(jnp.float32) @ w, -1), K)
        return ids, wts

    def moe(h, w_router, w_local, call_id):  # call_id [1] int32: step * LAYERS + layer, alike on every rank
        ids, wts = route(h, w_router)
        _, ex, _ = layer.dispatch(h, None, ids, m, wts, call_id=call_id)
        y = jnp.einsum("lch,lhd->lcd", ex, w_local.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
        return h + layer.combine(ids, wts, y.astype(jnp.bfloat16), m)  # a residual stream

    def moe_ref(h, w_router, w_all, _call_id):  # every expert here
        ids, wts = route(h, w_router)
        y = jnp.einsum("mh,ehd->emd", h, w_all.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
        y = y.astype(jnp.bfloat16)[ids, jnp.arange(h.shape[0])[:, None]]
        return h + (wts[..., None] * y.astype(jnp.float32)).sum(1).astype(jnp.bfloat16)

    def numbered(s):  # the call ids of step s's layers, [LAYERS, 1]: a rank out of step raises OutOfStep
        return jnp.asarray(s * LAYERS + np.arange(LAYERS, dtype=np.int32)[:, None])

    def loss_of(stack, x, target, w_router, w_experts, call_ids):
        out = jax.lax.scan(lambda h, p: (stack(h, *p), None), x, (w_router, w_experts, call_ids))[0]
        return ((out.astype(jnp.float32) - target) ** 2).mean()

    step = jax.jit(jax.value_and_grad(lambda w_r, w_e, ids: loss_of(moe, x, target, w_r, w_e, ids), (0, 1)))
    losses, worst = [], 0.0
    for s in range(args.steps):
        loss, (g_router, g_experts) = step(router, experts, numbered(s))
        g_router = sum(np.asarray(g) for g in comm.allgather(np.asarray(g_router)))  # replicated: summed
        losses.append(sum(comm.allgather(float(loss))) / W)
        if s == 0:  # the gradients of the mean over ranks of the loss, on one device, from every rank's data
            def total(w_r, w_e):
                return sum(loss_of(moe_ref, *data(q), w_r, w_e, numbered(0)) for q in range(W))
            want_r, want_e = jax.grad(total, (0, 1))(router, experts_all)
            for got, want in ((g_router, want_r), (g_experts, want_e[:, r * L:(r + 1) * L])):
                got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
                worst = max(worst, float(np.linalg.norm(got - want) / np.linalg.norm(want)))
        router = router - args.lr * g_router
        experts = experts - args.lr * g_experts
    worst = max(comm.allgather(worst))
    ok = losses[-1] < 0.8 * losses[0] and worst < 2e-2
    if r == 0:
        print(f"moecomm JAX training: {W} ranks, {M} tokens/rank, hidden {H}, {E} experts, top-{K}, {LAYERS} layers "
              f"under lax.scan")
        print("  loss per step: " + " ".join(f"{v:.4f}" for v in losses))
        print(f"  first step's gradients against one device: max relative error {worst:.2e}")
        print("  result: " + ("the loss falls and the gradients match" if ok else "FAILED"))
    layer.a2a.destroy()
    comm.finalize()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
