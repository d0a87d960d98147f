"""Errors inside jitted, scanned moecomm.jax steps reach every rank, and the next step is right:

    mpiexec -n 2 python tests/mpi_jax_errors.py                 # host transport, JAX's CPU backend
    mpirun -np 2 python tests/mpi_jax_errors.py                 # GPUs (MOECOMM_TRANSPORT=ipc: ranks may share one)
    mpirun -np 2 python tests/mpi_jax_errors.py --silent        # then the last rank misses a step

A step is ``lax.scan`` over two layers (dispatch with router weights -> the experts, the identity here ->
combine), routing given per layer, under ``jax.jit``; on GPUs ``XLA_FLAGS=--xla_gpu_graph_min_graph_size=1`` and
warm-up steps first, so that the faulty steps are replayed from XLA's command buffers with no Python per call
(the kernels find the fault). The faults, on the last rank: an expert id out of range in the second layer,
a bound_m above the rows, and (an AllToAll with capacity=2, overflow="error") all of its max_num_tokens tokens
routed to the same two experts. After each, every rank must have met a moecomm error for that step, raised by
the jitted call itself (where the handlers run: the host transport, XLA running the step op by op) or by
``layer.check()`` once the outputs are ready; a step that returned (replayed, nothing raised yet) must have
returned NaN in every value on every rank (``failed="nan"``), read before ``layer.check()``; and the next step
(fresh tokens, another m) must equal numpy's on every rank, rows >= m zero. With ``--silent`` the last rank then
skips a step (sleeping past the timeout) while the others run it: they must raise CommTimeout naming it.
Prints "<n> checks on <w> ranks: <f> failures".
"""
import argparse
import os
import re
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # ranks may share one GPU
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_graph_min_graph_size=1"

import numpy as np  # noqa: E402

import moecomm  # noqa: E402
from report import report  # noqa: E402

M, H, EL, K, LAYERS, TOL, TIMEOUT, CAPACITY = 16, 64, 2, 2, 2, 2e-2, 3.0, 2
ERRORS = tuple(n for n, c in vars(moecomm).items()  # the names of moecomm's errors (JAX wraps them as text)
               if isinstance(c, type) and issubclass(c, (moecomm.MoeCommError, moecomm.InvalidArgument)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--silent", action="store_true", help="end with the last rank missing a step")
    args = p.parse_args()
    comm = moecomm.init()
    import jax
    import jax.numpy as jnp

    import jax_layers
    import moecomm.jax as mj
    if comm.transport.memory == "host":
        jax.config.update("jax_platforms", "cpu")
    W, r, last = comm.world_size, comm.rank, comm.rank == comm.world_size - 1
    E = EL * W
    dev = jax.devices()[min(comm.device, len(jax.devices()) - 1)] if comm.device >= 0 else jax.devices("cpu")[0]
    put = lambda a: jax.device_put(a, dev)  # noqa: E731
    plain = mj.AllToAll(moecomm.AllToAll(comm, M, E, K, H, None, "bfloat16", "bfloat16", timeout=TIMEOUT))
    capped = mj.AllToAll(moecomm.AllToAll(comm, M, E, K, H, None, "bfloat16", "bfloat16", timeout=TIMEOUT,
                                          capacity=CAPACITY, overflow="error"))

    def stack(layer, x, m, ids, wts):
        def body(c, p):
            _, ex, _ = layer.dispatch(c, None, p[0], m, p[1])
            return layer.combine(p[0], None, ex, m), None  # the experts: the identity
        return jax.lax.scan(body, x, (ids, wts))[0]

    steps = {layer: jax.jit(lambda *a, layer=layer: stack(layer, *a)) for layer in (plain, capped)}
    rng = np.random.default_rng([r, 5])
    fails, checks, met = [], 0, {}  # met: fault -> the moecomm error this rank met (printed by rank 0)

    def draw(layer, fault=None):
        """This rank's inputs of a step (m drawn; ids distinct per token), with ``fault`` on the last rank."""
        m = int(rng.integers(1, M + 1))
        x = rng.standard_normal((M, H)).astype(moecomm.bfloat16)
        ids = np.stack([np.argsort(rng.random((M, E)), 1)[:, :K] for _ in range(LAYERS)]).astype(np.int32)
        wts = (rng.random((LAYERS, M, K)) / K).astype(np.float32)
        if layer is capped:  # CAPACITY pairs per expert at most: every rank's m * K pairs spread over the experts
            m = min(m, CAPACITY * E // (K * W))
            spread = (np.arange(M * K).reshape(M, K) + r * CAPACITY * E // W) % E
            ids = np.stack([spread] * LAYERS).astype(np.int32)
        if last and fault == "expert id out of range":
            ids[1, 0, 0] = E + 3
        if last and fault == "capacity overflow":
            m, ids[:] = M, np.tile(np.arange(K, dtype=np.int32), (M, 1))  # both layers: M pairs on experts 0, 1
        bound = M + 1 if last and fault == "bound_m above the rows" else m
        return m, x, ids, wts, bound

    def run(layer, inputs):
        """The step's output (numpy, read before layer.check(); None where the step itself raised) and the error
        text it met (None: none): the step's own, or layer.check()'s once the output is ready."""
        m, x, ids, wts, bound = inputs
        out = None
        try:
            out = steps[layer](put(jnp.asarray(x)), put(jnp.asarray([bound], jnp.int32)), put(jnp.asarray(ids)),
                               put(jnp.asarray(wts)))
            out = np.asarray(jax.block_until_ready(out))
            layer.check()
            return out, None
        except Exception as e:  # noqa: BLE001 - JAX wraps a handler's error in its own
            text = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            return out if isinstance(out, np.ndarray) else None, text

    def right(name, layer, inputs):
        """One good step: equal to numpy's (the kernels' rounding: float32 sums, bfloat16 results)."""
        nonlocal checks
        checks += 1
        m, x, ids, wts, _ = inputs
        out, error = run(layer, inputs)
        if error is not None:
            fails.append(f"rank {r}: {name}: raised {error}")
            return
        want = x.astype(np.float32)
        for n in range(LAYERS):  # every id valid: each token's output is its input times its weights' sum
            want = (want * wts[n].sum(1, keepdims=True)).astype(moecomm.bfloat16).astype(np.float32)
        got = out.astype(np.float32)
        err = jax_layers.relative_error(got[:m], want[:m])
        if not err < TOL:
            fails.append(f"rank {r}: {name}: m={m}: relative error {err:.3g}")
        if np.any(got[m:] != 0):
            fails.append(f"rank {r}: {name}: m={m}: rows >= m are not zeros")

    try:
        for layer in (plain, capped):  # warm-up: XLA records its command buffers
            for _ in range(3):
                right("warm-up", layer, draw(layer))
        for fault, layer in (("expert id out of range", plain), ("bound_m above the rows", plain),
                             ("capacity overflow", capped)):
            checks += 2
            out, error = run(layer, draw(layer, fault))
            met[fault] = next((n for n in ERRORS if error and n in error), None)
            if met[fault] is None:
                fails.append(f"rank {r}: {fault}: no moecomm error ({error})")
            if out is not None and not np.isnan(out.astype(np.float32)).all():  # returned, not raised: all NaN
                fails.append(f"rank {r}: {fault}: the failed step returned {np.isnan(out.astype(np.float32)).sum()}"
                             f" NaN of {out.size} values (moecomm.jax failed='nan': every row NaN)")
            right(f"the step after '{fault}'", layer, draw(layer))
        if args.silent:  # last: the communicator is broken afterwards
            checks += 1
            if last:
                time.sleep(3 * TIMEOUT)  # misses the step; its peers must name it
            else:
                _, error = run(plain, draw(plain))
                if error is None or "CommTimeout" not in error or not re.search(rf"rank\D{{0,6}}{W - 1}\b", error):
                    fails.append(f"rank {r}: a silent rank {W - 1}: not named by a CommTimeout ({error})")
    except Exception as e:  # noqa: BLE001 - every rank reports what it met
        fails.append(f"rank {r}: {type(e).__name__}: {str(e)[:300]}")
    if args.silent:  # the communicator is broken: gather the failures over plain MPI, leave without finalizing it
        from mpi4py import MPI
        status = report(MPI.COMM_WORLD.allgather(fails), checks, W, r)
        sys.stdout.flush()
        os._exit(status)
    for layer in (plain, capped):
        layer.a2a.destroy()
    seen = comm.allgather(met)
    if r == 0:
        for fault in met:
            print(f"{fault}: " + ", ".join(f"rank {q} {s.get(fault)}" for q, s in enumerate(seen)))
    everyone = comm.allgather(fails)
    comm.finalize()
    sys.exit(report(everyone, checks, W, r))


if __name__ == "__main__":
    main()
