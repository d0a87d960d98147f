"""The packed layout under MPI on the host transport: each rank's rows back to back, expert by expert,
equal to the padded layout's (the reference's) row for row, for every input dtype, with and without scales;
combine through the packed expert_y equals the reference; a per-rank capacity with "drop" drops exactly the
reference's pairs.

    mpiexec -n 3 python tests/mpi_packed.py

Prints "<n> checks on <w> ranks: <f> failures" on rank 0.
"""
import numpy as np

import moecomm
from moecomm import reference
from report import finish

E_PER_RANK, K, H, M = 3, 2, 128, 12
DTYPES = ((moecomm.bfloat16, None), (moecomm.float16, None), (moecomm.float8_e4m3fn, 4))


def draw(W, seed, dt, scales):
    E = E_PER_RANK * W
    out = []
    for q in range(W):
        rng = np.random.default_rng([seed, q])
        x = rng.standard_normal((M, H)).astype(np.float32).astype(dt)
        xs = rng.random((M, scales), np.float32) if scales else None
        ids = np.argsort(rng.random((M, E)), axis=1)[:, :K].astype(np.int32)
        ids[rng.random((M, K)) < 0.1] = -1
        out.append((x, xs, rng.random((M, K), np.float32), ids))
    return out


def check(a2a, comm, drawn, capacity, fails, label):
    W, r, E = comm.world_size, comm.rank, E_PER_RANK * comm.world_size
    c = a2a.cfg
    x, xs, w, ids = drawn[r]
    n, off = np.full(E_PER_RANK, -1, np.int32), np.full(E_PER_RANK + 1, -1, np.int32)
    ex = np.zeros(c.expert_x_shape(), c.in_dtype)
    es = None if xs is None else np.zeros(c.expert_x_scale_shape(), np.float32)
    m = np.array([M], np.int32)
    a2a.dispatch(n, ex, es, x, xs, ids, m, weights=w, out_expert_offsets=off)
    y = ex.astype(np.float32).astype(np.float16)  # the expert: identity in the output dtype
    out, dropped = np.zeros((M, H), np.float16), np.zeros((M, K), np.uint8)
    a2a.combine(out, ids, None, y, m, out_dropped=dropped)
    all_ids = [d[3] for d in drawn]
    drops = (reference.dropped(all_ids, E, W, capacity, per_rank=True) if capacity
             else [np.zeros(i.shape, bool) for i in all_ids])
    kept = [np.where(d, -1, i) for d, i in zip(drops, all_ids)]
    ref = reference.dispatch([d[0] for d in drawn], None if xs is None else [d[1] for d in drawn], kept, E, W, M)
    rows, offsets, scale_rows = reference.packed(ref[r])
    if not (np.array_equal(n, ref[r]["expert_num_tokens"]) and np.array_equal(off, offsets)):
        fails.append(f"{label}: counts {n.tolist()} / offsets {off.tolist()} != {offsets.tolist()}")
        return
    used = offsets[-1]
    if not np.array_equal(ex[:used].view(np.uint8), rows.view(np.uint8)):
        fails.append(f"{label}: packed rows differ from the padded layout's")
    if scale_rows is not None and not np.array_equal(es[:used], scale_rows):
        fails.append(f"{label}: packed scales differ")
    ref_y = [q["expert_x"].astype(np.float32).astype(np.float16) for q in ref]
    want = reference.combine(kept, [d[2] for d in drawn], ref_y, [q["origin"] for q in ref], E, W, np.float16)[r]
    if not np.allclose(out.astype(np.float32), want.astype(np.float32), rtol=2 ** -8, atol=1e-2):
        fails.append(f"{label}: combine through the packed expert_y differs from the reference")
    if not np.array_equal(dropped.astype(bool), drops[r]):
        fails.append(f"{label}: out_dropped differs from the reference's dropped pairs")


def main():
    comm = moecomm.init(transport="host", timeout=3.0)
    W = comm.world_size
    E = E_PER_RANK * W
    fails, checks = [], 0
    for dt, scales in DTYPES:
        a2a = moecomm.AllToAll(comm, M, E, K, H, scales, dt, "fp16", layout="packed")
        for seed in range(3):
            check(a2a, comm, draw(W, seed, dt, scales), None, fails, f"{np.dtype(dt).name} seed {seed}")
            checks += 1
        a2a.destroy()
    cap = M * K * W // (2 * W)  # rows per rank: about half the mean demand
    a2a = moecomm.AllToAll(comm, M, E, K, H, None, "bf16", "fp16", layout="packed", capacity=cap, overflow="drop")
    for seed in range(3):
        check(a2a, comm, draw(W, 10 + seed, moecomm.bfloat16, None), cap, fails, f"packed capacity {cap} seed {seed}")
        checks += 1
    a2a.destroy()
    finish(comm, fails, checks)


if __name__ == "__main__":
    main()
