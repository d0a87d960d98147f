"""moecomm.jax in JAX's SPMD form: one process per rank joined by ``jax.distributed.initialize``, a global mesh
with one device per process, the MoE layer inside ``jax.shard_map`` under ``jax.jit``:

    mpiexec -n 2 python tests/mpi_jax_spmd.py       # host transport, JAX's CPU backend
    mpirun -np 2 python tests/mpi_jax_spmd.py       # GPUs (one per rank; or MOECOMM_TRANSPORT=ipc, shared)

The layer: router top-k -> dispatch (router weights sent with it) -> every local expert one matmul over its
slots -> combine. Checked against plain JAX with every expert on this process's device, on this rank's rows
< m (m drawn per rank and step, relative L2 below 2e-2, bf16): one layer; ``lax.scan`` over two layers with
routing given per layer; and ``jax.grad`` of this rank's loss through one layer (gradients=True) for its
tokens (the router's path included) and its local experts' weights. Prints "<n> checks on <w> ranks: <f>
failures".
"""
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # ranks may share one GPU

import numpy as np  # noqa: E402

import moecomm  # noqa: E402
from report import finish  # noqa: E402

M, H, EL, K, LAYERS, TOL = 16, 64, 2, 2, 2, 2e-2


def main():
    comm = moecomm.init()
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_layers
    import moecomm.jax as mj
    from jax_layers import experts, reference as ref
    if comm.transport.memory == "host":
        jax.config.update("jax_platforms", "cpu")
    W, r = comm.world_size, comm.rank
    port = comm.allgather(int(np.random.default_rng().integers(20000, 40000)) if r == 0 else None)[0]
    local = [comm.device] if comm.device >= 0 else None  # this rank's GPU (ranks may share one)
    jax.distributed.initialize(f"localhost:{port}", num_processes=W, process_id=r, local_device_ids=local)
    fails, checks = [], 0
    try:
        E = EL * W
        a2a = moecomm.AllToAll(comm, M, E, K, H, None, "bfloat16", "bfloat16", gradients=True)
        layer = mj.AllToAll(a2a)
        mesh = Mesh(np.array([d for p in range(W) for d in jax.devices() if d.process_index == p]), ("ep",))
        keys = jax.random.split(jax.random.PRNGKey(11), 2)  # every rank draws the same weights
        w_router = np.asarray(jax.random.normal(keys[0], (LAYERS, H, E)) / H ** 0.5, np.float32)
        w_experts = np.asarray((jax.random.normal(keys[1], (LAYERS, E, H, H)) / H ** 0.5).astype(jnp.bfloat16))

        def shard(a):  # this rank's block of a global array whose first dimension is the mesh's
            return jax.make_array_from_process_local_data(NamedSharding(mesh, P("ep")), np.asarray(a)[None])

        def spmd(fn):  # fn on each rank's block (the leading mesh dimension dropped), jitted over the mesh
            body = lambda *a: jax.tree.map(lambda o: o[None], fn(*(b[0] for b in a)))  # noqa: E731
            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))

        def mine(out):
            return np.asarray(out.addressable_shards[0].data[0], np.float32)

        def route(x, w):
            return jax_layers.route(x, w, K)

        def moe(x, m, ids, wts, w_local):
            _, ex, _ = layer.dispatch(x, None, ids, m, wts)
            return layer.combine(ids, wts, experts(ex, w_local), m)

        def loss(out, m, target):
            o = out.astype(jnp.float32) * (jnp.arange(M) < m[0])[:, None]
            return (o * target).sum()

        def close(name, got, want, m=None):  # rows < m (all with None)
            nonlocal checks
            checks += 1
            err = jax_layers.relative_error(np.asarray(got)[:m], np.asarray(want)[:m])
            if not err < TOL:  # NaN fails
                fails.append(f"rank {r}: {name}: relative error {err:.3g}")

        mine_experts = slice(r * EL, (r + 1) * EL)
        one_layer = spmd(lambda x, m, wr, we: moe(x, m, *route(x, wr), we))
        stack = spmd(lambda x, m, ids, wts, we: jax.lax.scan(
            lambda c, p: (moe(c, m, p[0], p[1], p[2]), None), x, (ids, wts, we))[0])
        grads = spmd(lambda x, m, wr, we, t: jax.grad(
            lambda x, we: loss(moe(x, m, *route(x, wr), we), m, t), (0, 1))(x, we))
        for step in range(2):
            rng = np.random.default_rng([r, step])
            m_ = M if step == 1 else int(rng.integers(1, M))
            x = rng.standard_normal((M, H)).astype(np.float32).astype(moecomm.bfloat16)
            m = np.array([m_], np.int32)
            ids = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(M)]) for _ in range(LAYERS)]).astype(
                np.int32)
            wts = rng.random((LAYERS, M, K)).astype(np.float32)
            target = rng.standard_normal((M, H)).astype(np.float32)
            we_local = w_experts[:, mine_experts]

            got = one_layer(shard(x), shard(m), shard(w_router[0]), shard(we_local[0]))
            close("one layer", mine(got), ref(x, *route(x, w_router[0]), w_experts[0]), m_)

            got = stack(shard(x), shard(m), shard(ids), shard(wts), shard(we_local))
            want = x
            for n in range(LAYERS):
                want = ref(want, ids[n], wts[n], w_experts[n])
            close("lax.scan of two layers, routing given", mine(got), want, m_)

            # this rank's tokens get the gradient of its own loss; its local experts' weights that of every
            # rank's loss (every rank's tokens reach them): gathered, each rank's reference summed
            gx, gw = grads(shard(x), shard(m), shard(w_router[0]), shard(we_local[0]), shard(target))
            want_x = jax.grad(lambda x: loss(ref(x, *route(x, w_router[0]), w_experts[0]), m, target))(x)
            close("jax.grad: this rank's tokens", mine(gx), want_x, m_)
            inputs = comm.allgather((x, m, target))
            want_w = sum(jax.grad(lambda we, q=q: loss(ref(q[0], *route(q[0], w_router[0]), we), q[1], q[2]))(
                w_experts[0]) for q in inputs)
            close("jax.grad: local experts' weights", mine(gw), np.asarray(want_w, np.float32)[mine_experts])
        layer.check()
        a2a.destroy()
    except Exception as e:  # noqa: BLE001 - every rank reports what it met
        fails.append(f"rank {r}: {type(e).__name__}: {e}")
    jax.distributed.shutdown()
    finish(comm, fails, checks)


if __name__ == "__main__":
    main()
