"""Replicated experts through an ExpertMap, on either transport: every (token, logical expert) reaches
exactly one replica (the map's rule, computed on the host for the reference and in the kernels on GPUs),
counts and combine equal the reference, a map switch between calls is right before and after, a generation
mismatch raises on every rank and the next matching call works (with two ranks or more; one rank, as a GPU's
world size 1 takes the local path, checks the maps alone).

    mpiexec -n 3 python tests/mpi_replicas.py                       # host transport (numpy)
    mpirun -n 2 python tests/mpi_replicas.py --transport nvshmem    # GPUs (CuPy arrays)

Prints "<n> checks on <w> ranks: <f> failures" on rank 0.
"""
import argparse

import numpy as np

import moecomm
from moecomm import balance, reference
from report import finish

E_PER_RANK, SLOTS, K, H, M = 2, 4, 3, 64, 24


def call(a2a, comm, seed, hot=None):
    """One dispatch + combine (identity experts), checked: returns a list of failures."""
    xp = np
    if comm.transport.memory == "device":
        import cupy as xp
    W, r, E = comm.world_size, comm.rank, E_PER_RANK * comm.world_size
    k = min(K, E)
    fails = []
    drawn = []
    for q in range(W):
        rng = np.random.default_rng([seed, q])
        p = np.ones(E)
        if hot is not None:
            p[hot] = 3 * E  # one expert takes most of the traffic
        ids = np.stack([rng.choice(E, k, replace=False, p=p / p.sum()) for _ in range(M)]).astype(np.int32)
        drawn.append((rng.standard_normal((M, H)).astype(np.float16), rng.random((M, k), np.float32), ids))
    x, w, ids = (xp.asarray(a) for a in drawn[r])
    n = xp.full(SLOTS, -1, np.int32)
    ex = xp.zeros((SLOTS, M * W, H), np.float16)
    out = xp.zeros((M, H), np.float16)
    m = xp.array([M], np.int32)
    a2a.dispatch(n, ex, None, x, None, ids, m, weights=w)
    a2a.combine(out, ids, None, ex, m)
    a2a.synchronize()
    n, out = (a.get() if hasattr(a, "get") else a for a in (n, out))
    emap = a2a.expert_map
    phys = [emap.physical(d[2], np.arange(M), q) for q, d in enumerate(drawn)]
    ref = reference.dispatch([d[0] for d in drawn], None, phys, SLOTS * W, W, M)
    want = reference.combine(phys, [d[1] for d in drawn], [q["expert_x"] for q in ref], [q["origin"] for q in ref],
                             SLOTS * W, W, np.float16)[r]
    if not np.array_equal(n, ref[r]["expert_num_tokens"]):
        fails.append(f"seed {seed}: counts per slot {n.tolist()} != {ref[r]['expert_num_tokens'].tolist()}")
    if not np.allclose(out.astype(np.float32), want.astype(np.float32), rtol=2 ** -9, atol=1e-3):
        fails.append(f"seed {seed}: combine differs from the reference")
    # per logical expert: the replicas' counts add up to the pairs routed to it (exactly one replica each)
    per_slot = np.concatenate(comm.allgather(n))
    logical = np.bincount(emap.slots.ravel()[per_slot.nonzero()[0]], weights=per_slot[per_slot.nonzero()[0]],
                          minlength=E)
    routed = np.bincount(np.concatenate([d[2].ravel() for d in drawn]), minlength=E)
    if not np.array_equal(logical.astype(np.int64), routed):
        fails.append(f"seed {seed}: per logical expert {logical.tolist()} != routed {routed.tolist()}")
    return fails


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--transport", default="host")
    comm = moecomm.init(transport=p.parse_args().transport, timeout=3.0)
    W, r, last = comm.world_size, comm.rank, comm.world_size - 1
    E = E_PER_RANK * W
    a2a = moecomm.AllToAll(comm, M, E, min(K, E), H, None, "fp16", "fp16", slots_per_rank=SLOTS)
    fails, checks = [], 0
    for seed in range(4):  # the static map: one replica each, spare slots empty
        fails += call(a2a, comm, seed)
        checks += 1
    load = np.ones(E)
    load[1] = 3 * E
    planned = balance.plan(load, W, SLOTS, previous=a2a.expert_map)
    if planned.map.replicas()[1] != W:
        fails.append(f"the planner gave the hot expert {planned.map.replicas()[1]} replicas, expected {W}")
    a2a.set_expert_map(planned.map)  # the switch, between calls
    for seed in range(4, 10):
        fails += call(a2a, comm, seed, hot=1)
        checks += 1
    if W > 1:  # what needs two ranks: a rank behind the others, maps that differ
        # a rank that missed a switch (forced behind AllToAll's back): every rank raises, nothing routed
        stale = balance.ExpertMap(planned.map.slots, E, generation=planned.map.generation + 7)
        if r == last:
            a2a._backend.set_expert_map(stale)
        try:
            call(a2a, comm, 99)
            fails.append("a generation mismatch raised nothing")
        except moecomm.ExpertMapMismatch:
            pass
        if r == last:
            a2a._backend.set_expert_map(a2a.expert_map)
        fails += call(a2a, comm, 100, hot=1)  # the next matching call works
        checks += 2
        # maps that differ across ranks are refused on every rank, the map in use stays
        other = balance.ExpertMap.static(E, W, SLOTS, generation=5 + (r == last))
        try:
            a2a.set_expert_map(other)
            fails.append("different maps on different ranks were accepted")
        except moecomm.InvalidArgument:
            pass
        fails += call(a2a, comm, 101, hot=1)
        checks += 1
    a2a.destroy()
    finish(comm, fails, checks)


if __name__ == "__main__":
    main()
