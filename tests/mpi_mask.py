"""Masking a dead rank (elastic EP), on either transport: the survivors name it, mask it, keep serving on
the same AllToAll without it, and take it back when it returns.

    mpiexec -n 3 python tests/mpi_mask.py                       # host transport (numpy)
    mpirun -n 2 python tests/mpi_mask.py --transport nvshmem    # GPUs (CuPy arrays)
    mpiexec -disable-auto-cleanup -n 3 python -m moecomm.shield python tests/mpi_mask.py --kill   # SIGKILLed

The last rank stalls (it waits for a plain MPI message, standing in for a rank that stopped answering).
The survivors' next call raises CommTimeout naming it within the timeout + 1 s (by the end of the call or
at synchronize() on GPUs); they call ``a2a.mask_ranks([last])`` and run CALLS calls, each checked against
the reference with the last rank's experts removed (its ids replaced by -1), and ``stats()`` counts the
(token, expert) pairs not sent. Then the stalled rank returns: every rank calls ``mask_ranks([])`` and the
next CALLS calls are checked against the full reference. A second AllToAll holds every expert twice (rank q's
spare slots hold rank q+1's experts: ``slots_per_rank``, an expert map): masked the same way, its calls lose no
pair (the replica rule passes over the masked rank) and equal the full reference. Prints "<n> checks on <w>
ranks: <f> failures" on rank 0.

With ``--kill`` the last rank is killed (SIGKILL) instead, under a launcher that lets the others live on
(docs/operations.md: MPICH's mpiexec with -disable-auto-cleanup, each rank under moecomm.shield); the
survivors name it, mask it, serve, and report among themselves (it never comes back).
"""
import argparse
import os
import signal
import sys
import time

import numpy as np

import moecomm
from moecomm import reference
from report import report

E_PER_RANK, K, H, M, TIMEOUT, CALLS = 2, 3, 64, 16, 2.0, 10
TAG_RETURN = 77  # the plain MPI message that wakes the stalled rank


def host(a):
    return a.get() if hasattr(a, "get") else a


def draw(W, q, seed):
    """Rank q's tokens, router weights and expert ids for call ``seed`` (numpy; any rank can draw them)."""
    rng = np.random.default_rng([seed, q])
    E = E_PER_RANK * W
    return (rng.standard_normal((M, H)).astype(np.float16), rng.random((M, K), np.float32),
            np.argsort(rng.random((M, E)), axis=1)[:, :K].astype(np.int32))


def call_and_check(xp, a2a, W, r, seed, dead):
    """One dispatch + combine (the expert is the identity) on the ranks not in ``dead``; True when the
    counts and the combined tokens equal the reference in which the dead ranks' experts are removed.
    Returns (ok, pairs this rank routed to a dead rank's experts)."""
    drawn = [draw(W, q, seed) for q in range(W)]
    idx = [np.where(np.isin(i // E_PER_RANK, dead), -1, i) for _, _, i in drawn]
    for q in dead:  # a dead rank dispatches nothing
        idx[q] = np.full_like(idx[q], -1)
    x, w, ids = drawn[r]
    d_ids = xp.asarray(ids)
    n = xp.full(E_PER_RANK, -1, np.int32)
    ex = xp.zeros((E_PER_RANK, M * W, H), np.float16)
    out = xp.zeros((M, H), np.float16)
    m = xp.array([M], np.int32)
    a2a.dispatch(n, ex, None, xp.asarray(x), None, d_ids, m, weights=xp.asarray(w))
    a2a.combine(out, d_ids, None, ex, m)
    a2a.synchronize()
    ref = reference.dispatch([d[0] for d in drawn], None, idx, E_PER_RANK * W, W, M)
    want = reference.combine(idx, [d[1] for d in drawn], [q["expert_x"] for q in ref], [q["origin"] for q in ref],
                             E_PER_RANK * W, W, np.float16)[r]
    ok = (np.array_equal(host(n), ref[r]["expert_num_tokens"])
          and np.allclose(host(out).astype(np.float32), want.astype(np.float32), rtol=2 ** -9, atol=1e-3))
    return ok, int(np.isin(ids // E_PER_RANK, dead).sum())


def replicated(comm):
    """An AllToAll whose every expert has a second replica: rank q's spare slots hold rank q+1's experts."""
    from moecomm.balance import ExpertMap
    W, L = comm.world_size, E_PER_RANK
    a2a = moecomm.AllToAll(comm, M, L * W, K, H, None, "fp16", "fp16", slots_per_rank=2 * L)
    slots = np.array([np.concatenate([np.arange(q * L, q * L + L), np.arange(L) + (q + 1) % W * L])
                      for q in range(W)])
    a2a.set_expert_map(ExpertMap(slots, L * W, generation=1))
    return a2a


def call_replicated(xp, a2a, W, r, seed):
    """One dispatch + combine (the expert is the identity) on the AllToAll of :func:`replicated`; True when the
    combined tokens equal the full reference (every pair served by one replica or the other)."""
    drawn = [draw(W, q, seed) for q in range(W)]
    x, w, ids = drawn[r]
    d_ids, m = xp.asarray(ids), xp.array([M], np.int32)
    n = xp.zeros(2 * E_PER_RANK, np.int32)
    ex = xp.zeros((2 * E_PER_RANK, M * W, H), np.float16)
    out = xp.zeros((M, H), np.float16)
    a2a.dispatch(n, ex, None, xp.asarray(x), None, d_ids, m, weights=xp.asarray(w))
    a2a.combine(out, d_ids, None, ex, m)
    a2a.synchronize()
    idx = [d[2] for d in drawn]
    ref = reference.dispatch([d[0] for d in drawn], None, idx, E_PER_RANK * W, W, M)
    want = reference.combine(idx, [d[1] for d in drawn], [q["expert_x"] for q in ref], [q["origin"] for q in ref],
                             E_PER_RANK * W, W, np.float16)[r]
    return np.allclose(host(out).astype(np.float32), want.astype(np.float32), rtol=2 ** -9, atol=1e-3)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--transport", default="host")
    p.add_argument("--kill", action="store_true", help="the last rank is SIGKILLed instead of stalling")
    args = p.parse_args()
    transport = args.transport
    from mpi4py import MPI
    comm = moecomm.init(transport=transport, timeout=TIMEOUT)
    xp = np
    if transport != "host":
        import cupy as xp
    W, r, last = comm.world_size, comm.rank, comm.world_size - 1
    if W < 2:  # a rank to mask and a survivor to name it
        comm.finalize()
        sys.exit("mpi_mask.py needs 2 or more ranks (one of them stalls)")
    a2a = moecomm.AllToAll(comm, M, E_PER_RANK * W, K, H, None, "fp16", "fp16")
    twice = replicated(comm)
    fails, checks = [], 0
    ok, _ = call_and_check(xp, a2a, W, r, 0, [])
    if not ok:
        fails.append("the first call (every rank alive) is wrong")
    checks += 1

    if r == last and args.kill:
        os.kill(os.getpid(), signal.SIGKILL)
    if r == last:  # stalled until the survivors call it back
        MPI.COMM_WORLD.recv(source=0, tag=TAG_RETURN)
    else:
        t0 = time.monotonic()
        try:
            call_and_check(xp, a2a, W, r, 1, [])
            fails.append("a call with a stalled rank raised nothing")
        except moecomm.CommTimeout as e:
            if e.peer != last or time.monotonic() - t0 > TIMEOUT + 1:
                fails.append(f"the timeout names rank {e.peer} after {time.monotonic() - t0:.2f} s: {e}")
        try:
            a2a.dispatch(*[None] * 7)
            fails.append("a broken communicator accepted a call")
        except moecomm.CommBroken:
            pass
        a2a.mask_ranks([last])
        masked_pairs = 0
        for call in range(CALLS):
            ok, pairs = call_and_check(xp, a2a, W, r, 10 + call, [last])
            masked_pairs += pairs
            if not ok:
                fails.append(f"masked call {call} differs from the reference without rank {last}")
        stats = a2a.stats()
        if stats["MASKED_PAIRS"] != masked_pairs:
            fails.append(f"stats() counts {stats['MASKED_PAIRS']} masked pairs, expected {masked_pairs}")
        twice.mask_ranks([last])
        for call in range(CALLS):
            if not call_replicated(xp, twice, W, r, 10 + call):
                fails.append(f"masked call {call} with replicas differs from the full reference")
        if twice.stats()["MASKED_PAIRS"]:
            fails.append(f"with replicas, {twice.stats()['MASKED_PAIRS']} pairs were not sent (expected none)")
        checks += 5
        if args.kill:  # it never comes back: the survivors report among themselves (bounded) and exit
            everyone = comm.gather_among(fails, list(range(last)), "report")
            sys.exit(report(everyone, checks, W - 1, r))
        if r == 0:
            MPI.COMM_WORLD.send(None, dest=last, tag=TAG_RETURN)

    a2a.mask_ranks([])  # the stalled rank is back: every rank takes part
    twice.mask_ranks([])
    for call in range(CALLS):
        ok, _ = call_and_check(xp, a2a, W, r, 100 + call, [])
        if not ok:
            fails.append(f"call {call} after unmasking is wrong")
        if not call_replicated(xp, twice, W, r, 100 + call):
            fails.append(f"call {call} with replicas after unmasking is wrong")
    checks += 2

    everyone = MPI.COMM_WORLD.allgather(fails)
    comm.finalize()  # broken (masking leaves the communicator serving only through this AllToAll): local
    sys.exit(report(everyone, checks, W, r))


if __name__ == "__main__":
    main()
