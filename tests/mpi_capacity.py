"""Capacity with a stated policy, on either transport, at capacities below the demand: "drop" drops
exactly the pairs past each expert's capacity (reported per pair by out_dropped on the token's rank,
counted in stats() on the expert's rank) and combine equals the reference without them; "error" raises
CapacityExceeded on every rank naming an expert over capacity and its demand, and the next call (within
capacity) is right. Which pairs drop: the host transport drops the reference's (reference.dropped, checked
exactly); the kernels drop those whose slots were taken last, so on GPUs the check is per expert.

    mpiexec -n 3 python tests/mpi_capacity.py                       # host transport (numpy)
    mpirun -n 2 python tests/mpi_capacity.py --transport nvshmem    # GPUs (CuPy arrays)
    mpirun -n 2 python tests/mpi_capacity.py --transport ipc --max-tokens 2048   # a prefill-sized AllToAll
                                        # (moecomm.transport.gpu_plan.streamed: arrival words, the streamed combine)

Prints "<n> checks on <w> ranks: <f> failures" on rank 0.
"""
import argparse

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


def call(xp, a2a, comm, drawn, weights_at_combine=False):
    """One dispatch + combine (identity experts), synchronized; returns numpy (counts, out, out_dropped)."""
    x, w, ids = (xp.asarray(a) for a in drawn[comm.rank])
    n = xp.full(E_PER_RANK, -1, np.int32)
    ex = xp.zeros((E_PER_RANK, CAP, H), np.float16)
    out = xp.zeros((M, H), np.float16)
    dropped = xp.full((M, K), 7, np.uint8)
    m = xp.array([M], np.int32)
    a2a.dispatch(n, ex, None, x, None, ids, m, weights=w)
    a2a.combine(out, ids, w if weights_at_combine else None, ex, m, out_dropped=dropped)
    a2a.synchronize()
    return tuple(a.get() if hasattr(a, "get") else a for a in (n, out, dropped))


def check_drops(comm, drawn, n, out, dropped, exact, what):
    """Failures of one "drop" call: per expert, the pairs flagged in out_dropped (gathered) are its demand past
    CAP; combine and counts equal the reference without them; ``exact``: they are the reference's pairs."""
    W, r, E = comm.world_size, comm.rank, E_PER_RANK * comm.world_size
    fails = []
    ids = [d[2] for d in drawn]
    flags = [f.astype(bool) for f in comm.allgather(dropped)]
    all_ids = np.concatenate([i.ravel() for i in ids])
    demand = np.bincount(all_ids[all_ids >= 0], minlength=E)
    flagged = np.concatenate([i[f] for i, f in zip(ids, flags)])
    if (flagged < 0).any():
        fails.append(f"{what}: out_dropped flags a pair with no expert")
    if not np.array_equal(np.bincount(flagged[flagged >= 0], minlength=E), np.maximum(demand - CAP, 0)):
        fails.append(f"{what}: pairs dropped per expert {np.bincount(flagged[flagged >= 0], minlength=E).tolist()}, "
                     f"demand past capacity {np.maximum(demand - CAP, 0).tolist()}")
    if exact and not np.array_equal(flags[r], reference.dropped(ids, E, W, CAP)[r]):
        fails.append(f"{what}: out_dropped differs from the reference's dropped pairs")
    kept = [np.where(f, -1, i) for f, i in zip(flags, ids)]
    ref = reference.dispatch([d[0] for d in drawn], None, kept, E, W, M)
    want = reference.combine(kept, [d[1] for d in drawn], [q["expert_x"] for q in ref], [q["origin"] for q in ref],
                             E, W, np.float16)[r]
    if not np.array_equal(n, ref[r]["expert_num_tokens"]):
        fails.append(f"{what}: counts {n.tolist()} != {ref[r]['expert_num_tokens'].tolist()}")
    if not np.allclose(out.astype(np.float32), want.astype(np.float32), rtol=2 ** -9, atol=1e-3):
        fails.append(f"{what}: combine differs from the reference without the dropped pairs")
    return fails, np.maximum(demand - CAP, 0)[r * E_PER_RANK:(r + 1) * E_PER_RANK]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--transport", default="host")
    p.add_argument("--max-tokens", type=int, default=M, help="the AllToAlls' max_num_tokens (calls send M tokens)")
    args = p.parse_args()
    transport, max_tokens = args.transport, max(M, args.max_tokens)
    comm = moecomm.init(transport=transport, timeout=3.0)
    W, r = comm.world_size, comm.rank
    E = E_PER_RANK * W
    xp = np
    if transport != "host":
        import cupy as xp
    fails, checks = [], 0
    drop = moecomm.AllToAll(comm, max_tokens, E, K, H, None, "fp16", "fp16", capacity=CAP, overflow="drop")
    dropped_here = np.zeros(E_PER_RANK, np.int64)
    for seed in range(8):  # weights sent with dispatch (expert-side sums), then weights at combine
        drawn = draw(W, seed, hot=seed % E)
        got = call(xp, drop, comm, drawn, weights_at_combine=seed >= 4)
        f, over = check_drops(comm, drawn, *got, exact=transport == "host", what=f"seed {seed}")
        fails += f
        dropped_here += over
        checks += 1
    s = drop.stats()
    if s["DROPPED_PAIRS"] != dropped_here.sum() or not np.array_equal(s["dropped"], dropped_here):
        fails.append(f"stats() counts {s['DROPPED_PAIRS']} dropped pairs here ({s['dropped'].tolist()} per expert), "
                     f"expected {dropped_here.tolist()}")
    checks += 1
    drop.destroy()

    error = moecomm.AllToAll(comm, max_tokens, E, K, H, None, "fp16", "fp16", capacity=CAP, overflow="error")
    drawn = draw(W, 50, hot=1)
    try:
        call(xp, error, comm, drawn)
        fails.append("a capacity below the demand raised nothing")
    except moecomm.CapacityExceeded as e:
        all_ids = np.concatenate([d[2].ravel() for d in drawn])
        demand = np.bincount(all_ids[all_ids >= 0], minlength=E)
        if not (0 <= e.expert < E and demand[e.expert] > CAP and (e.demand, e.capacity) == (demand[e.expert], CAP)):
            fails.append(f"CapacityExceeded names expert {e.expert} demand {e.demand} capacity {e.capacity}; demands "
                         f"{demand.tolist()}, capacity {CAP}")
        pairs_over = int(np.maximum(demand - CAP, 0).sum())
        if transport == "host" and f"{pairs_over} pairs over in all" not in str(e):  # the host sees every demand
            fails.append(f"CapacityExceeded does not count the {pairs_over} pairs over: {e}")
    all_ids = np.concatenate([d[2].ravel() for d in drawn])
    over = np.maximum(np.bincount(all_ids[all_ids >= 0], minlength=E) - CAP, 0)[r * E_PER_RANK:(r + 1) * E_PER_RANK]
    if error.stats()["OVERFLOW_PAIRS"] != over.sum():
        fails.append(f"stats() counts {error.stats()['OVERFLOW_PAIRS']} pairs past capacity here, expected "
                     f"{over.sum()}")
    drawn = draw(W, 51, hot=None)
    for d in drawn:  # 2 tokens per rank: at most 2 * W <= CAP pairs per expert
        d[2][2:] = -1
    n, out, dropped = call(xp, error, comm, drawn)
    ids = [d[2] for d in drawn]
    ref = reference.dispatch([d[0] for d in drawn], None, ids, E, W, M)
    want = reference.combine(ids, [d[1] for d in drawn], [q["expert_x"] for q in ref], [q["origin"] for q in ref],
                             E, W, np.float16)[r]
    if not (np.array_equal(n, ref[r]["expert_num_tokens"]) and dropped.sum() == 0
            and np.allclose(out.astype(np.float32), want.astype(np.float32), rtol=2 ** -9, atol=1e-3)):
        fails.append("the call after CapacityExceeded is wrong")
    checks += 2
    # a refused argument on the last rank: the call's first exchange (the demand) carries the refusal
    x, w, ids = (xp.asarray(a) for a in drawn[r])
    bad_x = x.astype(np.float32) if r == W - 1 else x
    ex, m = xp.zeros((E_PER_RANK, CAP, H), np.float16), xp.array([M], np.int32)
    try:  # the refusing rank's call ends at its dispatch; the others raise by the end of theirs
        error.dispatch(xp.zeros(E_PER_RANK, np.int32), ex, None, bad_x, None, ids, m, weights=w)
        error.combine(xp.zeros((M, H), np.float16), ids, None, ex, m)
        error.synchronize()
        fails.append("a refused argument raised nothing")
    except (moecomm.InvalidArgument, moecomm.PeerError) as e:
        if isinstance(e, moecomm.InvalidArgument) != (r == W - 1):
            fails.append(f"rank {r} raised {type(e).__name__} for a bad argument on rank {W - 1}")
    n, out, dropped = call(xp, error, comm, drawn)
    if not np.array_equal(n, ref[r]["expert_num_tokens"]):
        fails.append("the call after a refused argument is wrong")
    checks += 1
    error.destroy()
    finish(comm, fails, checks)


if __name__ == "__main__":
    main()
