"""The control path under MPI on the host transport: a failed call is still collective, calls that do not
belong together are refused, equal configurations compare equal. Every rank checks what it raised.

    mpiexec -n 3 python tests/mpi_control.py

* a bad argument on the last rank, at each argument position of dispatch and of combine: the last rank
  raises InvalidArgument, every other rank PeerError naming it, within the timeout; the next call is
  correct on every rank;
* AllToAll construction with a bad argument on one rank raises on every rank; dtypes spelled differently
  on different ranks ("fp16", np.float16) are the same configuration;
* every rank dispatching twice without combining: InvalidArgument on every rank, and the next call works;
* a combine whose bound_m differs from the dispatched m on one rank: InvalidArgument there, PeerError
  on the others;
* two AllToAlls called in different orders on different ranks: OutOfStep on every rank, after which the
  communicator is broken (CommBroken at once) and finalize() does not wait.
Prints "<n> checks on <w> ranks: <f> failures" on rank 0.
"""
import sys
import time

import numpy as np

import moecomm
from moecomm import reference

E_PER_RANK, K, H, M, TIMEOUT = 2, 2, 64, 8, 2.0


def good(W, r, seed):
    """Valid dispatch arguments of rank r of W (any rank can draw any rank's)."""
    rng = np.random.default_rng([seed, r])
    E = E_PER_RANK * W
    return dict(out_expert_num_tokens=np.full(E_PER_RANK, -1, np.int32),
                out_expert_x=np.zeros((E_PER_RANK, M * W, H), np.float16),
                out_expert_x_scale=None,
                dp_x=rng.standard_normal((M, H)).astype(np.float16), dp_x_scale=None,
                indices=np.argsort(rng.random((M, E)), axis=1)[:, :K].astype(np.int32),
                bound_m=np.array([M], np.int32), weights=rng.random((M, K), np.float32))


def roundtrip(comm, a2a, seed):
    """A valid dispatch + combine (the expert is the identity), checked against the reference."""
    W, r = comm.world_size, comm.rank
    everyone = [good(W, q, seed) for q in range(W)]
    args = everyone[r]
    a2a.dispatch(**args)
    out = np.zeros((M, H), np.float16)
    a2a.combine(out, args["indices"], None, args["out_expert_x"], args["bound_m"])
    ref = reference.dispatch([a["dp_x"] for a in everyone], None, [a["indices"] for a in everyone],
                             E_PER_RANK * W, W, M)
    want = reference.combine([a["indices"] for a in everyone], [a["weights"] for a in everyone],
                             [q["expert_x"] for q in ref], [q["origin"] for q in ref], E_PER_RANK * W, W,
                             np.float16)[r]
    return (np.array_equal(args["out_expert_num_tokens"], ref[r]["expert_num_tokens"])
            and np.allclose(out.astype(np.float32), want.astype(np.float32), rtol=2 ** -9, atol=1e-3))


BAD_DISPATCH = {  # argument -> a bad value of it (given by the last rank only)
    "out_expert_num_tokens": lambda a: np.zeros(E_PER_RANK, np.int64),
    "out_expert_x": lambda a: np.zeros((E_PER_RANK, 1, H), np.float16),
    "out_expert_x_scale": lambda a: np.zeros((1,), np.float32),
    "dp_x": lambda a: a["dp_x"].astype(np.float32),
    "dp_x_scale": lambda a: np.zeros((M, 1), np.float32),
    "indices": lambda a: a["indices"][:, :1].copy(),
    "bound_m": lambda a: np.array([M], np.int64),
    "weights": lambda a: np.zeros((M, K + 1), np.float32),
}
BAD_COMBINE = {
    "out_tokens": lambda a: np.zeros((M, H), np.float32),
    "indices": lambda a: a["indices"].astype(np.int16),
    "weights": lambda a: np.zeros((M, K), np.float64),
    "expert_y": lambda a: a["out_expert_x"][:1],
    "bound_m": lambda a: np.zeros((2,), np.int32),
}


def expect(fails, label, call, kinds, peer=None):
    """Run ``call``; record a failure unless it raises one of ``kinds`` (naming ``peer``) in time."""
    t0 = time.monotonic()
    try:
        call()
    except kinds as e:
        took = time.monotonic() - t0
        if peer is not None and getattr(e, "peer", None) != peer:
            fails.append(f"{label}: {type(e).__name__} names peer {getattr(e, 'peer', None)}, expected {peer}")
        if took > TIMEOUT:
            fails.append(f"{label}: raised after {took:.2f} s")
        return e
    except Exception as e:  # noqa: BLE001 - any other outcome is the failure being reported
        fails.append(f"{label}: raised {type(e).__name__}: {e}")
        return None
    fails.append(f"{label}: no error raised")
    return None


def main():
    comm = moecomm.init(transport="host", timeout=TIMEOUT)
    W, r, last = comm.world_size, comm.rank, comm.world_size - 1
    fails, checks = [], 0
    a2a = moecomm.AllToAll(comm, M, E_PER_RANK * W, K, H, None, "fp16" if r % 2 else np.float16, "float16")
    checks += 1  # the spellings of one configuration were accepted as equal

    # a bad argument at each position: collective, and the next call is right
    for i, (name, bad) in enumerate(BAD_DISPATCH.items()):
        args = good(W, r, i)
        if r == last:
            args[name] = bad(args)
        kinds = moecomm.InvalidArgument if r == last else moecomm.PeerError
        expect(fails, f"dispatch with a bad {name} on rank {last}", lambda: a2a.dispatch(**args), kinds,
               None if r == last else last)
        if not roundtrip(comm, a2a, 100 + i):
            fails.append(f"the call after a bad dispatch {name} is wrong")
        checks += 1
    for i, (name, bad) in enumerate(BAD_COMBINE.items()):
        args = good(W, r, 200 + i)
        a2a.dispatch(**args)
        cargs = dict(out_tokens=np.zeros((M, H), np.float16), indices=args["indices"], weights=None,
                     expert_y=args["out_expert_x"], bound_m=args["bound_m"])
        if name == "weights":
            cargs["weights"] = args["weights"]
        if r == last:
            cargs[name] = bad(args)
        kinds = moecomm.InvalidArgument if r == last else moecomm.PeerError
        expect(fails, f"combine with a bad {name} on rank {last}", lambda: a2a.combine(**cargs), kinds,
               None if r == last else last)
        a2a.combine(np.zeros((M, H), np.float16), args["indices"], None, args["out_expert_x"], args["bound_m"])
        if not roundtrip(comm, a2a, 300 + i):
            fails.append(f"the call after a bad combine {name} is wrong")
        checks += 1

    # combine with another m than the dispatch's, on the last rank
    args = good(W, r, 400)
    a2a.dispatch(**args)
    m = np.array([M - 1 if r == last else M], np.int32)
    expect(fails, "combine with another bound_m", lambda: a2a.combine(np.zeros((M, H), np.float16), args["indices"],
           None, args["out_expert_x"], m), moecomm.InvalidArgument if r == last else moecomm.PeerError,
           None if r == last else last)
    a2a.combine(np.zeros((M, H), np.float16), args["indices"], None, args["out_expert_x"], args["bound_m"])
    if not roundtrip(comm, a2a, 401):
        fails.append("the call after a combine with another bound_m is wrong")
    checks += 1

    # every rank dispatches twice without combining
    args = good(W, r, 500)
    a2a.dispatch(**args)
    expect(fails, "a second dispatch before combine", lambda: a2a.dispatch(**args), moecomm.InvalidArgument)
    a2a.combine(np.zeros((M, H), np.float16), args["indices"], None, args["out_expert_x"], args["bound_m"])
    if not roundtrip(comm, a2a, 501):
        fails.append("the call after a refused second dispatch is wrong")
    checks += 1

    # construction with a bad argument on the last rank
    kinds = moecomm.InvalidArgument
    expect(fails, "AllToAll with a bad hidden_dim on one rank",
           lambda: moecomm.AllToAll(comm, M, E_PER_RANK * W, K, H + (1 if r == last else 0), None, "fp16", "fp16"),
           kinds)
    checks += 1

    # two AllToAlls in different orders on different ranks
    b2b = moecomm.AllToAll(comm, M, E_PER_RANK * W, K, H, None, "fp16", "fp16")
    first = b2b if r == last else a2a
    args = good(W, r, 600)
    e = expect(fails, "AllToAlls called in different orders", lambda: first.dispatch(**args), moecomm.OutOfStep)
    if e is not None and "AllToAll #" not in str(e):
        fails.append(f"OutOfStep does not say which calls met: {e}")
    expect(fails, "a call on a broken communicator", lambda: a2a.dispatch(**args), moecomm.CommBroken)
    checks += 2
    t0 = time.monotonic()
    comm.finalize()  # broken: local only, no wait
    if time.monotonic() - t0 > 0.5:
        fails.append(f"finalize of a broken communicator took {time.monotonic() - t0:.2f} s")

    # report over plain MPI (the communicator is broken by design here)
    from mpi4py import MPI
    everyone = MPI.COMM_WORLD.gather(fails, root=0)
    if r == 0:
        for f in sum(everyone, []):
            print("FAIL", f)
        print(f"{checks} checks on {W} ranks: {len(sum(everyone, []))} failures", flush=True)
    sys.exit(1 if r == 0 and any(everyone) else 0)


if __name__ == "__main__":
    main()
