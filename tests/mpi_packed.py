"""The layouts whose rows are placed grouped by source, on either transport: the packed layout (each rank's rows
back to back, expert by expert) and the padded one with group_by_source, each expert's rows from each source
rank equal to the reference's for every input dtype, with and without scales, sources in rank order (and as
AllToAll.source_layout describes them in the padded layout, its add_counts included, written by the dispatch
given them as its sources too; the packed layout refuses them); combine
through their expert_y equals the reference; a capacity (per rank packed, per expert padded) with "drop" drops
the demand past it (exactly the reference's pairs on the host transport) and combine equals the reference
without them; "error" raises CapacityExceeded on every rank and the next call is right.

    mpiexec -n 3 python tests/mpi_packed.py                       # host transport (numpy)
    mpirun -n 2 python tests/mpi_packed.py --transport nvshmem    # GPUs (CuPy arrays)

Prints "<n> checks on <w> ranks: <f> failures" on rank 0.
"""
import argparse

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


def put(xp, a):
    """An array on the transport's side: numpy, or CuPy (raw bytes for dtypes CuPy lacks)."""
    if a is None or xp is np:
        return a
    return xp.asarray(a.view(f"u{a.dtype.itemsize}") if a.dtype.name in ("bfloat16", "float8_e4m3fn") else a)


def get(a, dtype):
    return (a.get() if hasattr(a, "get") else a).view(dtype)


def check(xp, a2a, comm, drawn, capacity, fails, label):
    """One dispatch + combine with the rows placed grouped by source: the packed layout, or the padded one with
    group_by_source. Within one source's rows of an expert the order is arrival's on GPUs, so each expert's rows
    from each source (with their scales) are compared as a set with the reference's (whose rows go by source,
    then token); which pairs a capacity (rows per rank packed, slots per expert padded) drops is the
    reference's on the host transport, on GPUs checked by count."""
    W, r, E = comm.world_size, comm.rank, E_PER_RANK * comm.world_size
    c = a2a.cfg
    packed = c.layout == "packed"
    x, xs, w, ids = drawn[r]
    n = xp.full(E_PER_RANK, -1, np.int32)
    off = xp.full(E_PER_RANK + 1, -1, np.int32) if packed else None
    ex = put(xp, np.zeros(c.expert_x_shape(), c.in_dtype))
    es = None if xs is None else xp.zeros(c.expert_x_scale_shape(), np.float32)
    m, d_ids = xp.array([M], np.int32), xp.asarray(ids)
    layouts = []  # the slots of each source rank (DeepEP's handle): written by the dispatch, then by source_layout
    if not packed:
        layouts = [moecomm.SourceLayout(xp.full(c.expert_x_shape()[:-1], 99, np.int32),  # no token is 99
                                        xp.full((E_PER_RANK, W), 7, np.int64), xp.full(E_PER_RANK, base, np.int32))
                   for base in (3, 5)]  # every slot and range written; the counts added to these
    a2a.dispatch(n, ex, es, put(xp, x), put(xp, xs), d_ids, m, weights=xp.asarray(w), out_expert_offsets=off,
                 sources=layouts[0] if layouts else None)
    if layouts:
        a2a.source_layout(*layouts[1][:2], add_counts=layouts[1].add_counts)
    ex_h = get(ex, c.in_dtype)
    y = xp.asarray(ex_h.astype(np.float32).astype(np.float16))  # the expert: identity in the output dtype
    out, dropped = xp.zeros((M, H), np.float16), xp.zeros((M, K), np.uint8)
    a2a.combine(out, d_ids, None, y, m, out_dropped=dropped)
    a2a.synchronize()
    n, out, dropped = get(n, np.int32), get(out, np.float16), get(dropped, np.uint8)
    all_ids = [d[3] for d in drawn]
    flags = [f.astype(bool) for f in comm.allgather(dropped)]
    if capacity:
        key, keys = (E_PER_RANK, W) if packed else (1, E)  # a capacity per rank, or per expert
        demand = [sum(int(((i // key) == q).sum()) for i in all_ids) for q in range(keys)]
        over = [sum(int(((i[f] // key) == q).sum()) for i, f in zip(all_ids, flags)) for q in range(keys)]
        if over != [max(0, d - capacity) for d in demand]:
            fails.append(f"{label}: pairs dropped per {'rank' if packed else 'expert'} {over}, demand past "
                         f"capacity {[max(0, d - capacity) for d in demand]}")
        if comm.transport.memory == "host" and not np.array_equal(
                flags[r], reference.dropped(all_ids, E, W, capacity, per_rank=packed)[r]):
            fails.append(f"{label}: out_dropped differs from the reference's dropped pairs")
    elif any(f.any() for f in flags):
        fails.append(f"{label}: pairs dropped without a capacity")
    kept = [np.where(f, -1, i) for f, i in zip(flags, all_ids)]
    refs = reference.dispatch([d[0] for d in drawn], None if xs is None else [d[1] for d in drawn], kept, E, W, M)
    ref = refs[r]
    counts = ref["expert_num_tokens"]
    first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    if packed and not np.array_equal(get(off, np.int32), first):
        fails.append(f"{label}: offsets {get(off, np.int32).tolist()} != {first.tolist()}")
        return
    if not np.array_equal(n, counts):
        fails.append(f"{label}: counts {n.tolist()} != {counts.tolist()}")
        return
    for how, (src_info, layout_range, added), base in zip(("dispatch(sources=)", "source_layout"), layouts, (3, 5)):
        check_sources(get(src_info, np.int32), get(layout_range, np.int64), ref["origin"], counts, W, fails,
                      f"{label}, {how}")
        if not np.array_equal(get(added, np.int32), base + counts):
            fails.append(f"{label}, {how}: add_counts {get(added, np.int32).tolist()} != {base} + "
                         f"{counts.tolist()}")
    es_h = None if es is None else get(es, np.float32)
    for e in range(E_PER_RANK):  # each expert's rows from each source, as sets (sorted)
        rows = slice(first[e], first[e + 1]) if packed else (e, slice(0, counts[e]))
        got = [ex_h[rows], None if es_h is None else es_h[rows]]
        want = [ref["expert_x"][e, :counts[e]], None if es_h is None else ref["expert_x_scale"][e, :counts[e]]]
        sources = ref["origin"][e, :counts[e], 0]
        for s in np.unique(sources):
            a, b = np.searchsorted(sources, s), np.searchsorted(sources, s, "right")
            part = lambda arrays: [None if v is None else v[a:b] for v in arrays]
            if not np.array_equal(reference.canonical_rows(b - a, *part(got)),
                                  reference.canonical_rows(b - a, *part(want))):
                fails.append(f"{label}: expert {e}'s rows {a}..{b - 1} (and scales) are not source {s}'s")
                break
    ref_y = [q["expert_x"].astype(np.float32).astype(np.float16) for q in refs]
    want_out = reference.combine(kept, [d[2] for d in drawn], ref_y, [q["origin"] for q in refs], E, W, np.float16)[r]
    if not np.allclose(out.astype(np.float32), want_out.astype(np.float32), rtol=2 ** -8, atol=1e-2):
        fails.append(f"{label}: combine through the expert_y differs from the reference")


def check_sources(src_info, layout_range, origin, counts, W, fails, label):
    """A source layout (AllToAll.source_layout's arrays) against the reference's origin (rows by source, then
    token): each source's (first slot << 32) | slots in each expert, 0 where none; its slots' tokens as a set
    (arrival order on GPUs); -1 in the empty slots."""
    for e, n in enumerate(counts):
        src = origin[e, :n, 0]
        for q in range(W):
            a, b = (int(v) for v in np.searchsorted(src, [q, q + 1]))
            want = a << 32 | (b - a) if b > a else 0
            if layout_range[e, q] != want or sorted(src_info[e, a:b]) != sorted(origin[e, a:b, 1]):
                fails.append(f"{label}: expert {e}, source {q}: range {int(layout_range[e, q]):#x} "
                             f"tokens {sorted(src_info[e, a:b])}, expected {want:#x} {sorted(origin[e, a:b, 1])}")
                return
        if (src_info[e, n:] != -1).any():
            fails.append(f"{label}: expert {e}'s empty slots are not -1")
            return


def refuse_sources(xp, a2a, comm, fails):
    """The packed layout has no source layout: a dispatch given sources is refused on every rank, naming them."""
    c, W = a2a.cfg, comm.world_size
    sources = moecomm.SourceLayout(xp.zeros((E_PER_RANK, c.expert_capacity), np.int32),
                                   xp.zeros((E_PER_RANK, W), np.int64))
    try:
        a2a.dispatch(xp.zeros(E_PER_RANK, np.int32), put(xp, np.zeros(c.expert_x_shape(), c.in_dtype)), None,
                     put(xp, np.zeros((M, H), c.in_dtype)), None, xp.full((M, K), -1, np.int32),
                     xp.array([M], np.int32), out_expert_offsets=xp.zeros(E_PER_RANK + 1, np.int32), sources=sources)
        fails.append("packed: a dispatch given sources was not refused")
    except moecomm.InvalidArgument as e:
        if not str(e).startswith("sources: needs the padded layout"):
            fails.append(f"packed: a dispatch given sources was refused as {e}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--transport", default="host")
    transport = p.parse_args().transport
    comm = moecomm.init(transport=transport, timeout=3.0)
    xp = np
    if transport != "host":
        import cupy as xp
    W = comm.world_size
    E = E_PER_RANK * W
    fails, checks = [], 0
    grouped = dict(layout="padded", group_by_source=True)
    for dt, scales in DTYPES:
        for name, layout in (("packed", dict(layout="packed")), ("padded by source", grouped)):
            a2a = moecomm.AllToAll(comm, M, E, K, H, scales, dt, "fp16", **layout)
            for seed in range(3):
                check(xp, a2a, comm, draw(W, seed, dt, scales), None, fails,
                      f"{name} {np.dtype(dt).name} seed {seed}")
                checks += 1
            a2a.destroy()
    cap = M * K // (2 * E_PER_RANK)  # slots per expert: about half the mean demand
    a2a = moecomm.AllToAll(comm, M, E, K, H, 4, moecomm.float8_e4m3fn, "fp16", capacity=cap, overflow="drop",
                           **grouped)
    for seed in range(3):
        check(xp, a2a, comm, draw(W, 30 + seed, moecomm.float8_e4m3fn, 4), cap, fails,
              f"padded by source, capacity {cap} seed {seed}")
        checks += 1
    a2a.destroy()
    a2a = moecomm.AllToAll(comm, M, E, K, H, None, "bf16", "fp16", capacity=cap, overflow="error", **grouped)
    try:
        check(xp, a2a, comm, draw(W, 40, moecomm.bfloat16, None), cap, fails, "padded by source 'error'")
        fails.append("padded by source 'error': a capacity below the demand raised nothing")
    except moecomm.CapacityExceeded as e:
        if not (0 <= e.expert < E and e.demand > cap and e.capacity == cap):
            fails.append(f"padded by source 'error': CapacityExceeded names expert {e.expert} demand {e.demand} "
                         f"capacity {e.capacity}, expected an expert, > {cap}, {cap}")
    drawn = draw(W, 41, moecomm.bfloat16, None)
    for d in drawn:  # one token per rank: at most W <= cap pairs per expert where W <= cap
        d[3][1:] = -1
    if W <= cap:
        check(xp, a2a, comm, drawn, cap, fails, "padded by source 'error', the next call")
    checks += 2
    a2a.destroy()
    cap = M * K * W // (2 * W)  # rows per rank: about half the mean demand
    a2a = moecomm.AllToAll(comm, M, E, K, H, None, "bf16", "fp16", layout="packed", capacity=cap, overflow="drop")
    for seed in range(3):
        check(xp, a2a, comm, draw(W, 10 + seed, moecomm.bfloat16, None), cap, fails,
              f"packed capacity {cap} seed {seed}")
        checks += 1
    a2a.destroy()
    a2a = moecomm.AllToAll(comm, M, E, K, H, None, "bf16", "fp16", layout="packed", capacity=cap, overflow="error")
    try:
        check(xp, a2a, comm, draw(W, 20, moecomm.bfloat16, None), cap, fails, "packed 'error'")
        fails.append("packed 'error': a capacity below the demand raised nothing")
    except moecomm.CapacityExceeded as e:
        if e.expert != -1 or not e.demand > cap or e.capacity != cap:
            fails.append(f"packed 'error': CapacityExceeded names expert {e.expert} demand {e.demand} capacity "
                         f"{e.capacity}, expected -1 (the rank's rows), > {cap}, {cap}")
    drawn = draw(W, 21, moecomm.bfloat16, None)
    for d in drawn:  # 2 tokens per rank: at most 2 * K * W <= cap rows per rank
        d[3][2:] = -1
    check(xp, a2a, comm, drawn, cap, fails, "packed 'error', the next call")
    refuse_sources(xp, a2a, comm, fails)
    check(xp, a2a, comm, drawn, cap, fails, "packed, the call after a refused one")
    checks += 4
    a2a.destroy()
    finish(comm, fails, checks)


if __name__ == "__main__":
    main()
