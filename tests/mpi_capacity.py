"""Capacity with a stated policy, under MPI on the host transport, at capacities below the demand:
"drop" counts the dropped pairs exactly (per call on the origin, in stats() on the expert's rank) and
combine equals the reference without them; "error" raises CapacityExceeded on every rank naming the expert
and its demand, and the next call (within capacity) is right.

    mpiexec -n 3 python tests/mpi_capacity.py

Prints "<n> checks on <w> ranks: <f> failures" on rank 0.
"""
import numpy as np

import moecomm
from moecomm import reference
from report import finish

E_PER_RANK, K, H, M, CAP = 2, 2, 64, 16, 6


def draw(W, seed, hot):
    """Every rank's (x, weights, ids): a hot expert gets far more than CAP pairs when ``hot`` is set."""
    E = E_PER_RANK * W
    out = []
    for q in range(W):
        rng = np.random.default_rng([seed, q])
        p = np.ones(E)
        if hot is not None:
            p[hot] = 4 * E
        ids = np.stack([rng.choice(E, K, replace=False, p=p / p.sum()) for _ in range(M)]).astype(np.int32)
        ids[rng.random((M, K)) < 0.1] = -1
        out.append((rng.standard_normal((M, H)).astype(np.float16), rng.random((M, K), np.float32), ids))
    return out


def call(a2a, comm, drawn):
    x, w, ids = drawn[comm.rank]
    n = np.full(E_PER_RANK, -1, np.int32)
    ex = np.zeros((E_PER_RANK, CAP, H), np.float16)
    out = np.zeros((M, H), np.float16)
    dropped = np.full((M, K), 7, np.uint8)
    m = np.array([M], np.int32)
    a2a.dispatch(n, ex, None, x, None, ids, m, weights=w)
    a2a.combine(out, ids, None, ex, m, out_dropped=dropped)
    return n, out, dropped


def main():
    comm = moecomm.init(transport="host", timeout=3.0)
    W, r = comm.world_size, comm.rank
    E = E_PER_RANK * W
    fails, checks = [], 0
    drop = moecomm.AllToAll(comm, M, E, K, H, None, "fp16", "fp16", capacity=CAP, overflow="drop")
    total_dropped_here = 0
    for seed in range(6):
        drawn = draw(W, seed, hot=seed % E)
        n, out, dropped = call(drop, comm, drawn)
        ids = [d[2] for d in drawn]
        want_drop = reference.dropped(ids, E, W, CAP)
        kept = [np.where(d, -1, i) for d, i in zip(want_drop, ids)]
        ref = reference.dispatch([d[0] for d in drawn], None, kept, E, W, M)
        want = reference.combine(kept, [d[1] for d in drawn], [q["expert_x"] for q in ref], [q["origin"] for q in ref],
                                 E, W, np.float16)[r]
        if not np.array_equal(dropped.astype(bool), want_drop[r]):
            fails.append(f"seed {seed}: out_dropped differs from the reference's dropped pairs")
        if not np.array_equal(n, ref[r]["expert_num_tokens"]):
            fails.append(f"seed {seed}: counts {n.tolist()} != {ref[r]['expert_num_tokens'].tolist()}")
        if not np.allclose(out.astype(np.float32), want.astype(np.float32), rtol=2 ** -9, atol=1e-3):
            fails.append(f"seed {seed}: combine differs from the reference without the dropped pairs")
        all_ids = np.concatenate([i.ravel() for i in ids])
        demand = np.bincount(all_ids[all_ids >= 0], minlength=E)[r * E_PER_RANK:(r + 1) * E_PER_RANK]
        total_dropped_here += int(np.maximum(demand - CAP, 0).sum())
        checks += 1
    if drop.stats()["DROPPED_PAIRS"] != total_dropped_here:
        fails.append(f"stats() counts {drop.stats()['DROPPED_PAIRS']} dropped pairs here, expected {total_dropped_here}")
    checks += 1
    drop.destroy()

    error = moecomm.AllToAll(comm, M, E, K, H, None, "fp16", "fp16", capacity=CAP, overflow="error")
    drawn = draw(W, 50, hot=1)
    try:
        call(error, comm, drawn)
        fails.append("a capacity below the demand raised nothing")
    except moecomm.CapacityExceeded as e:
        all_ids = np.concatenate([d[2].ravel() for d in drawn])
        demand = np.bincount(all_ids[all_ids >= 0], minlength=E)
        first = int(np.argmax(demand > CAP))
        if (e.expert, e.demand, e.capacity) != (first, demand[first], CAP):
            fails.append(f"CapacityExceeded names expert {e.expert} demand {e.demand}, expected {first} {demand[first]}")
    drawn = draw(W, 51, hot=None)
    for d in drawn:  # 2 tokens per rank: at most 2 * W <= CAP pairs per expert
        d[2][2:] = -1
    n, out, dropped = call(error, comm, drawn)
    ids = [d[2] for d in drawn]
    ref = reference.dispatch([d[0] for d in drawn], None, ids, E, W, M)
    want = reference.combine(ids, [d[1] for d in drawn], [q["expert_x"] for q in ref], [q["origin"] for q in ref],
                             E, W, np.float16)[r]
    if not (np.array_equal(n, ref[r]["expert_num_tokens"]) and dropped.sum() == 0
            and np.allclose(out.astype(np.float32), want.astype(np.float32), rtol=2 ** -9, atol=1e-3)):
        fails.append("the call after CapacityExceeded is wrong")
    checks += 2
    # a refused argument on the last rank: the call's first exchange (the demand) carries the refusal
    x, w, ids = drawn[r]
    bad_x = x.astype(np.float32) if r == W - 1 else x
    try:
        error.dispatch(np.zeros(E_PER_RANK, np.int32), np.zeros((E_PER_RANK, CAP, H), np.float16), None, bad_x, None,
                       ids, np.array([M], np.int32), weights=w)
        fails.append("a refused argument raised nothing")
    except (moecomm.InvalidArgument, moecomm.PeerError) as e:
        if isinstance(e, moecomm.InvalidArgument) != (r == W - 1):
            fails.append(f"rank {r} raised {type(e).__name__} for a bad argument on rank {W - 1}")
    n, out, dropped = call(error, comm, drawn)
    if not np.array_equal(n, ref[r]["expert_num_tokens"]):
        fails.append("the call after a refused argument is wrong")
    checks += 1
    error.destroy()
    finish(comm, fails, checks)


if __name__ == "__main__":
    main()
