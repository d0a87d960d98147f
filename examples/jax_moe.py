"""A whole MoE layer in JAX on moecomm, in JAX's SPMD form: one process per rank joined by
``jax.distributed.initialize``, a global mesh with one device per process, the layer inside ``jax.shard_map``
under ``jax.jit``. Checked against the same layer computed on one device in plain JAX, with new tokens and a
new token count m at every step.

    mpirun -np 2 python examples/jax_moe.py [--jax-first]

The layer: router top-k (jax.lax.top_k) -> dispatch -> every local expert as one batched matmul over its
slots -> combine (router weights sent with dispatch, summed on the expert side). It runs twice per step:
with whole dispatch/combine calls, and with split halves and other work (a shared expert) in between. Each
rank's tokens, m and local experts' weights are its block of global arrays sharded over the mesh axis "ep".
``--jax-first`` starts JAX (``jax.distributed.initialize``) before moecomm.init(); by default JAX starts
after it. Both work.

JAX preallocates 75 % of every GPU it sees, so each rank's process must see only its own GPU: this script
sets CUDA_VISIBLE_DEVICES from the launcher's local rank (Open MPI, MPICH, Slurm, torchrun) before anything
initialises CUDA (``srun --gpus-per-task=1`` does the same). No other setting is needed; JAX keeps its
default preallocation.
"""
import os


def _own_gpu():
    """Show this process only the GPU of its local rank (before any CUDA initialisation)."""
    for var in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"):
        if os.environ.get(var, "").isdigit():
            local, visible = int(os.environ[var]), os.environ.get("CUDA_VISIBLE_DEVICES")
            os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[local] if visible else str(local)
            return


_own_gpu()

import argparse  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402


def step_time(fn, *args, steps=50):
    """Microseconds per call of a jitted function, with ``steps`` calls queued before one wait."""
    import time
    fn(*args)[0].block_until_ready()
    t0 = time.perf_counter()
    for _ in range(steps):
        out = fn(*args)
    out[0].block_until_ready()
    return (time.perf_counter() - t0) / steps * 1e6


def start_jax(mpi_comm):
    """Join every rank's process into one JAX runtime: rank 0's host coordinates, at a port it draws."""
    import socket

    import jax
    here = (socket.gethostname(), int(np.random.default_rng().integers(20000, 40000))) if mpi_comm.rank == 0 else None
    host, port = mpi_comm.bcast(here)
    jax.distributed.initialize(f"{host}:{port}", num_processes=mpi_comm.size, process_id=mpi_comm.rank)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=128, help="max tokens per rank")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    p.add_argument("--experts-per-rank", type=int, default=4, help="experts on each rank (default 4)")
    p.add_argument("--topk", type=int, default=4, help="experts per token (default 4)")
    p.add_argument("--steps", type=int, default=6, help="steps (default 6)")
    p.add_argument("--jax-first", action="store_true", help="start JAX before moecomm.init()")
    args = p.parse_args()
    from mpi4py import MPI
    if args.jax_first:
        start_jax(MPI.COMM_WORLD)
    import moecomm
    comm = moecomm.init()
    if not args.jax_first:
        start_jax(MPI.COMM_WORLD)
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import moecomm.jax

    W, rank, M, H, K = comm.world_size, comm.rank, args.tokens, args.hidden, args.topk
    E, L = args.experts_per_rank * W, args.experts_per_rank
    a2a = moecomm.AllToAll(comm, M, E, K, H, None, "bfloat16", "bfloat16")
    layer = moecomm.jax.AllToAll(a2a)
    mesh = Mesh(np.array([d for q in range(W) for d in jax.devices() if d.process_index == q]), ("ep",))

    def shard(block):
        """The global array whose block on this rank (along the mesh axis "ep") is ``block``."""
        return jax.make_array_from_process_local_data(NamedSharding(mesh, P("ep")), np.asarray(block)[None])

    def mine(a):
        """This rank's block of a global array sharded over "ep"."""
        return np.asarray(a.addressable_shards[0].data[0], np.float32)

    def spmd(fn):
        """``fn`` on each rank's blocks (the mesh dimension dropped), jitted over the mesh."""
        body = lambda *a: jax.tree.map(lambda o: o[None], fn(*(b[0] for b in a)))  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))

    keys = jax.random.split(jax.random.PRNGKey(0), 3)  # every rank draws the same weights
    w_router = np.asarray(jax.random.normal(keys[0], (H, E)) / H ** 0.5, np.float32)
    w_experts = np.asarray((jax.random.normal(keys[1], (E, H, H)) / H ** 0.5).astype(jnp.bfloat16))
    w_shared = np.asarray((jax.random.normal(keys[2], (H, H)) / H ** 0.5).astype(jnp.bfloat16))
    w_local = shard(w_experts[rank * L:(rank + 1) * L])  # each rank's block: its own experts

    def route(x):
        weights, ids = jax.lax.top_k(jax.nn.softmax(x.astype(jnp.float32) @ w_router, -1), K)
        return weights, ids  # float32, int32 [rows, K]

    def experts(expert_x, w):
        return jnp.einsum("lch,lhd->lcd", expert_x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    @spmd
    def moe(x, m, w, call_id):  # call_id [1] int32: the program's number of the call, equal on every rank
        weights, ids = route(x)
        counts, expert_x, _ = layer.dispatch(x, None, ids, m, weights, call_id=call_id)
        return layer.combine(ids, None, experts(expert_x, w), m), counts

    @spmd
    def moe_split(x, m, w, call_id):
        weights, ids = route(x)
        sent = layer.dispatch_send(x, None, ids, m, weights, call_id=call_id)
        shared = x @ w_shared  # runs while the tokens fly
        counts, expert_x, _ = layer.dispatch_recv(sent)
        back = layer.combine_send(ids, None, experts(expert_x, w), m)
        return layer.combine_recv(back), counts, shared

    @jax.jit
    def reference(x):
        """The same layer on this process's device alone, all experts local."""
        weights, ids = route(x)
        y_all = jnp.einsum("mh,ehd->emd", x, w_experts, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
        y = y_all[ids, jnp.arange(x.shape[0])[:, None]]
        return (weights[..., None] * y.astype(jnp.float32)).sum(1)

    ok, worst = True, 0.0
    for step in range(args.steps):
        rng = np.random.default_rng([step, rank])
        m = int(rng.integers(1, M + 1))
        x_local = rng.standard_normal((M, H)).astype(np.float32).astype(moecomm.bfloat16)
        x, bound_m = shard(x_local), shard(np.array([m], np.int32))
        want = np.asarray(reference(x_local))[:m]
        for n, fn in enumerate((moe, moe_split)):  # numbered calls: a rank out of step raises OutOfStep
            out, counts = fn(x, bound_m, w_local, shard(np.array([2 * step + n], np.int32)))[:2]
            out = mine(out)[:m]
            layer.check()  # raises what the kernels recorded (a peer's timeout, bad ids)
            err = float(np.linalg.norm(out - want) / np.linalg.norm(want))
            received = sum(comm.allgather(int(mine(counts).sum())))
            sent = sum(comm.allgather(m)) * K  # every id is an expert: each (token, k) lands once
            worst = max(worst, err)
            ok = ok and err < 2e-2 and received == sent
    timed_id = shard(np.array([-2], np.int32))  # the timed steps' calls, alike on every rank
    per_step = {name: step_time(fn, x, bound_m, w_local, timed_id)
                for name, fn in (("layer", moe), ("split layer", moe_split))}
    layer.check()
    results = comm.allgather((ok, worst))
    if rank == 0:
        print(f"JAX MoE layer: {W} ranks, {M} tokens/rank max, hidden {H}, {E} experts, top-{K}, in shard_map "
              f"over a {W}-device mesh (whole and split calls), JAX started "
              f"{'before' if args.jax_first else 'after'} moecomm.init()")
        print("  time per jitted step (50 steps queued, then one wait): "
              + ", ".join(f"{k} {v:.0f} us" for k, v in per_step.items()))
        for r, (good, e) in enumerate(results):
            print(f"  rank {r}: worst relative error vs one-device JAX {e:.2e}  {'OK' if good else 'MISMATCH'}")
        print("result:", "all ranks match" if all(g for g, _ in results) else "MISMATCH")
    a2a.destroy()
    jax.distributed.shutdown()
    comm.finalize()
    sys.exit(0 if all(g for g, _ in results) else 1)


if __name__ == "__main__":
    main()
