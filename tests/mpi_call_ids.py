"""A rank that skips a call is named, not paired with its peers' next call, when the program numbers its calls
(dispatch(call_id=...)), on either transport:

    mpiexec -n 3 python tests/mpi_call_ids.py [--jax]                      # host transport
    mpirun -n 2 python tests/mpi_call_ids.py --transport ipc [--jax]       # GPUs

Every rank runs three calls numbered 0, 1, 2 (checked against the reference), then the last rank skips call 3, as
a ``lax.cond`` whose predicate differs between ranks would: its call 4 meets the others' call 3. Counting calls
cannot see it (each rank is at its fourth call); the call ids can: OutOfStep on every rank, naming the program's
calls, and the communicator is broken (CommBroken at the next call). ``--jax``: the same inside jitted
``moecomm.jax`` steps, the layer under ``lax.cond`` on the rank-dependent predicate, the call id a traced value.
Prints "<n> checks on <w> ranks: <f> failures" on rank 0.
"""
import argparse
import sys

import numpy as np

import moecomm
from moecomm import reference
from report import report

E_PER_RANK, K, H, M = 2, 2, 64, 16


def drawn(W, q, step):
    """Rank q's tokens, router weights and expert ids of step ``step``."""
    rng = np.random.default_rng([step, q])
    return (rng.standard_normal((M, H)).astype(np.float16), rng.random((M, K), np.float32),
            np.argsort(rng.random((M, E_PER_RANK * W)), axis=1)[:, :K].astype(np.int32))


def want(W, r, step):
    """Rank r's combined tokens of step ``step`` (the experts are the identity)."""
    d = [drawn(W, q, step) for q in range(W)]
    ref = reference.dispatch([x for x, _, _ in d], None, [i for _, _, i in d], E_PER_RANK * W, W, M)
    return reference.combine([i for _, _, i in d], [w for _, w, _ in d], [q["expert_x"] for q in ref],
                             [q["origin"] for q in ref], E_PER_RANK * W, W, np.float16)[r].astype(np.float32)


def eager_step(xp, a2a, W, r, step, call_id):
    x, w, ids = drawn(W, r, step)
    d_ids, m = xp.asarray(ids), xp.array([M], np.int32)
    n, ex = xp.zeros(E_PER_RANK, np.int32), xp.zeros((E_PER_RANK, M * W, H), np.float16)
    out = xp.zeros((M, H), np.float16)
    a2a.dispatch(n, ex, None, xp.asarray(x), None, d_ids, m, weights=xp.asarray(w),
                 call_id=xp.array([call_id], np.int32))
    a2a.combine(out, d_ids, None, ex, m)
    a2a.synchronize()
    return np.asarray(out.get() if hasattr(out, "get") else out, np.float32)


def jax_steps(comm, a2a):
    """(run(step, call_id, take) -> combined tokens or None where ``take`` is False): the layer inside a jitted
    lax.cond on ``take``, the call id traced."""
    import jax
    import jax.numpy as jnp

    import moecomm.jax as mj
    if comm.transport.memory == "host":
        jax.config.update("jax_platforms", "cpu")
    layer = mj.AllToAll(a2a)
    W, r = comm.world_size, comm.rank

    @jax.jit
    def step(x, w, ids, m, call_id, take):
        def moe(x):
            _, ex, _ = layer.dispatch(x, None, ids, m, w, call_id=call_id)
            return layer.combine(ids, None, ex, m)
        return jax.lax.cond(take, moe, lambda x: jnp.zeros_like(x), x)

    def run(s, call_id, take):
        x, w, ids = drawn(W, r, s)
        out = step(jnp.asarray(x), jnp.asarray(w), jnp.asarray(ids), jnp.asarray([M], jnp.int32),
                   jnp.asarray([call_id], jnp.int32), take)
        out = np.asarray(out, np.float32)
        layer.check()
        return out if take else None
    return run


def raised(fn):
    """The exception ``fn()`` raised, or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the caller checks what it is
        return e
    return None


def is_(error, kind):
    """Whether ``error`` is moecomm's ``kind``, or JAX's runtime error carrying its message (an FFI handler's)."""
    return isinstance(error, kind) or (error is not None and f"{kind.__name__}: " in str(error))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--transport", default="host")
    p.add_argument("--jax", action="store_true", help="the layer in jitted moecomm.jax steps under lax.cond")
    opts = p.parse_args()
    comm = moecomm.init(transport=opts.transport, timeout=5.0)
    W, r = comm.world_size, comm.rank
    if W < 2:  # a rank to skip a call and a peer to meet it
        comm.finalize()
        sys.exit("mpi_call_ids.py needs 2 or more ranks (one skips a call)")
    xp = np
    if comm.transport.memory == "device":
        import cupy as xp
    a2a = moecomm.AllToAll(comm, M, E_PER_RANK * W, K, H, None, np.float16, np.float16)
    run = jax_steps(comm, a2a) if opts.jax else (lambda s, cid, take: eager_step(xp, a2a, W, r, s, cid))
    fails, checks = [], 0
    for s in range(3):
        got = run(s, s, True)
        if not np.allclose(got, want(W, r, s), rtol=2 ** -9, atol=1e-3):
            fails.append(f"rank {r}: call {s} differs from the reference")
        checks += 1
    skipper = r == W - 1
    e = raised(lambda: (run(3, 3, False) if opts.jax else None, run(4, 4, True)) if skipper else run(3, 3, True))
    if not is_(e, moecomm.OutOfStep):  # under jit a handler's error is JAX's, carrying moecomm's message
        fails.append(f"rank {r}: a skipped call raised " + (f"{type(e).__name__}: {e}" if e else "nothing"))
    elif "call_id" not in str(e) or not ("call 3" in str(e) and "call 4" in str(e)):
        fails.append(f"rank {r}: OutOfStep does not name the program's calls 3 and 4: {e}")
    e = raised(lambda: run(5, 5, True))
    if not is_(e, moecomm.CommBroken):
        fails.append(f"rank {r}: a call after OutOfStep raised " + (f"{type(e).__name__}: {e}" if e else "nothing"))
    checks += 2
    comm.finalize()
    from mpi4py import MPI
    sys.exit(report(MPI.COMM_WORLD.allgather(fails), checks, W, r))


if __name__ == "__main__":
    main()
