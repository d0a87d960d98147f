"""Telemetry on either transport: what AllToAll.stats() reports equals counts computed independently from
the routing, over many calls with skewed and uniform traffic, varying m, split halves and (GPUs) CUDA-graph
replay.

    mpiexec -n 3 python tests/mpi_telemetry.py                       # host transport (numpy)
    mpirun -n 2 python tests/mpi_telemetry.py --transport nvshmem    # GPUs (CuPy arrays)

Checked on every rank: the window (pairs routed to each local expert per call, the last WINDOW calls),
tokens received per expert, CALLS, bytes per peer (what a rank sent to a peer is what that peer received
from it; dispatch bytes are the records sent times the record size, on every transport), timing=True gives one time
per eager call, telemetry_window=0 keeps no window, and telemetry.from_stats summarises the gathered
snapshots; with num_tags and score_gap, the pairs per tag and local expert and every rank's tokens per
router-confidence bin equal numpy's counts, and a tag out of range fails its call on every rank. Prints "<n>
checks on <w> ranks: <f> failures" on rank 0.
"""
import argparse

import numpy as np

import moecomm
from moecomm import reference, telemetry
from moecomm._abi import RecordLayout
from report import finish

E_PER_RANK, K, H, M, WINDOW, CALLS, TAGS = 3, 2, 64, 24, 16, 40, 3


def draw(W, seed):
    """Every rank's (m, x, weights, ids) of call ``seed``: Zipf-skewed routing on even calls, uniform on odd."""
    E = E_PER_RANK * W
    out = []
    for q in range(W):
        rng = np.random.default_rng([seed, q])
        p = 1.0 / np.arange(1, E + 1) ** 1.2 if seed % 2 == 0 else np.ones(E)
        p = rng.permutation(p) / p.sum()
        ids = np.stack([rng.choice(E, K, replace=False, p=p) for _ in range(M)]).astype(np.int32)
        ids[rng.random((M, K)) < 0.05] = -1
        m = int(rng.integers(0, M + 1))
        out.append((m, rng.standard_normal((M, H)).astype(np.float16), rng.random((M, K), np.float32), ids))
    return out


def demand(drawn, W):
    """[W * E_PER_RANK] pairs routed to each expert in one call (the reference for the window)."""
    ids = np.concatenate([d[3][:d[0]].ravel() for d in drawn])
    return np.bincount(ids[ids >= 0], minlength=W * E_PER_RANK)


def records_to(drawn_r, W):
    """[W] tokens of one rank that reach each rank (one record per token and destination rank)."""
    m, _, _, ids = drawn_r
    ids = ids[:m]
    return np.array([((ids // E_PER_RANK) == d).any(axis=1).sum() for d in range(W)])


def run(xp, a2a, drawn, r, split):
    m, x, w, ids = drawn[r]
    n = xp.zeros(E_PER_RANK, np.int32)
    ex = xp.zeros((E_PER_RANK, M * len(drawn), H), np.float16)
    out = xp.zeros((M, H), np.float16)
    args = (n, ex, None, xp.asarray(x), None, xp.asarray(ids), xp.array([m], np.int32))
    if split:  # send and receive halves as separate calls
        a2a.dispatch(*args, do_recv=False, weights=xp.asarray(w))
        a2a.dispatch(*args, do_send=False, weights=xp.asarray(w))
        a2a.combine(out, args[5], None, ex, args[6], do_recv=False)
        a2a.combine(out, args[5], None, ex, args[6], do_send=False)
    else:
        a2a.dispatch(*args, weights=xp.asarray(w))
        a2a.combine(out, args[5], None, ex, args[6])
    a2a.synchronize()


def graph_calls(a2a, drawn, r, replays):
    """GPUs: one dispatch + combine captured into a CUDA graph, replayed ``replays`` times."""
    import cupy
    m, x, w, ids = drawn[r]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        arrays = dict(n=cupy.zeros(E_PER_RANK, np.int32), ex=cupy.zeros((E_PER_RANK, M * len(drawn), H), np.float16),
                      x=cupy.asarray(x), ids=cupy.asarray(ids), m=cupy.array([m], np.int32), w=cupy.asarray(w),
                      out=cupy.zeros((M, H), np.float16))
        stream.synchronize()
        a = arrays
        stream.begin_capture(cupy.cuda.runtime.streamCaptureModeRelaxed)
        a2a.dispatch(a["n"], a["ex"], None, a["x"], None, a["ids"], a["m"], weights=a["w"], stream=stream)
        a2a.combine(a["out"], a["ids"], None, a["ex"], a["m"], stream=stream)
        graph = stream.end_capture()
        for _ in range(replays):
            graph.launch(stream)
        stream.synchronize()
    a2a.synchronize(stream)


def tags_and_gap(comm, xp, fails):
    """An AllToAll with tags and router confidence (num_tags=TAGS, score_gap=True): over calls whole and split,
    stats()["by_tag"] equals a numpy count of the pairs each local expert received per tag (a token of tag -1,
    given no tags, counts none) and stats()["score_gap"] numpy's binning of every rank's tokens' gaps; a tag out of
    range on the last rank fails that call on every rank (InvalidArgument there, PeerError on the others) and the
    next call is counted right. Returns the number of checks."""
    from moecomm import _constants as C
    W, r, E, L = comm.world_size, comm.rank, E_PER_RANK * comm.world_size, E_PER_RANK
    a2a = moecomm.AllToAll(comm, M, E, K, H, None, "fp16", "fp16", telemetry_window=WINDOW, num_tags=TAGS,
                           score_gap=True)
    want_tags, want_gap = [], []

    def call(c, bad=False):
        drawn = draw(W, 2000 + c)
        tags = [np.random.default_rng([c, q]).integers(0, TAGS, M).astype(np.int32) for q in range(W)]
        mine = tags[r].copy()
        if bad:
            mine[drawn[r][0] - 1 if drawn[r][0] else 0] = TAGS
        m, x, w, ids = drawn[r]
        n, ex = xp.zeros(L, np.int32), xp.zeros((L, M * W, H), np.float16)
        args = (n, ex, None, xp.asarray(x), None, xp.asarray(ids), xp.array([m], np.int32))
        a2a.dispatch(*args, weights=xp.asarray(w), tags=xp.asarray(mine), do_recv=c % 2 == 0)
        if c % 2:
            a2a.dispatch(*args, weights=xp.asarray(w), tags=xp.asarray(mine), do_send=False)
        a2a.combine(xp.zeros((M, H), np.float16), args[5], None, ex, args[6])
        a2a.synchronize()
        counts = np.zeros((TAGS, L), np.int64)
        for q, (mq, _, _, iq) in enumerate(drawn):
            t, k = np.nonzero((iq[:mq] >= r * L) & (iq[:mq] < (r + 1) * L))
            np.add.at(counts, (tags[q][t], iq[:mq][t, k] - r * L), 1)
        want_tags.append(counts)
        want_gap.append(np.bincount(reference.score_gap_bins(ids[:m], w[:m]), minlength=C.GAP_BINS))

    for c in range(CALLS):
        call(c)
    s = a2a.stats()  # the window of the good calls (a failed call may leave a row on GPUs: checked apart)
    got_tags, got_gap = s["by_tag"], s["score_gap"]["counts"]
    if not np.array_equal(got_tags, np.array(want_tags[-len(got_tags):])):
        fails.append(f"by_tag differs from numpy's count (last call):\n{got_tags[-1]}\n{want_tags[-1]}")
    if not np.array_equal(got_gap, np.array(want_gap[-len(got_gap):])):
        fails.append(f"score_gap differs from numpy's binning:\n{got_gap.tolist()}\n{want_gap}")
    if s["score_gap"]["edges"] != list(C.GAP_EDGES) or got_tags.shape[1:] != (TAGS, L):
        fails.append(f"score_gap edges {s['score_gap']['edges']}, by_tag shape {got_tags.shape}")
    e = None
    try:
        call(CALLS, bad=r == W - 1)
        fails.append("a tag out of range raised nothing")
    except (moecomm.InvalidArgument, moecomm.PeerError) as err:
        e = err
    if e is not None and type(e) is not (moecomm.InvalidArgument if r == W - 1 else moecomm.PeerError):
        fails.append(f"a tag out of range on rank {W - 1} raised {type(e).__name__} here: {e}")
    call(CALLS + 1)
    s = a2a.stats()  # the call after the failed one: counted right in the window's last row
    if not (np.array_equal(s["by_tag"][-1], want_tags[-1])
            and np.array_equal(s["score_gap"]["counts"][-1], want_gap[-1])):
        fails.append(f"the call after a tag out of range is counted wrong: {s['by_tag'][-1].tolist()} "
                     f"{s['score_gap']['counts'][-1].tolist()}, expected {want_tags[-1].tolist()} "
                     f"{want_gap[-1].tolist()}")
    a2a.destroy()
    return 5


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--transport", default="host")
    transport = p.parse_args().transport
    comm = moecomm.init(transport=transport, timeout=5.0)
    W, r = comm.world_size, comm.rank
    E, L = E_PER_RANK * W, E_PER_RANK
    gpu = transport != "host"
    xp = np
    if gpu:
        import cupy as xp
    fails, checks = [], 0
    a2a = moecomm.AllToAll(comm, M, E, K, H, None, "fp16", "fp16", telemetry_window=WINDOW, timing=True)
    rows, received, records = [], np.zeros(L, np.int64), np.zeros(W, np.int64)
    for c in range(CALLS):
        drawn = draw(W, c)
        run(xp, a2a, drawn, r, split=c % 3 == 1)
        d = demand(drawn, W)[r * L:(r + 1) * L]
        rows.append(d)
        received += d
        records += records_to(drawn[r], W)
    replays = 5 if gpu else 0
    if gpu:  # replays of one captured call: each adds the same row
        drawn = draw(W, 1000)
        graph_calls(a2a, drawn, r, replays)
        rows += [demand(drawn, W)[r * L:(r + 1) * L]] * replays
        received += replays * demand(drawn, W)[r * L:(r + 1) * L]
        records += replays * records_to(drawn[r], W)
    s = a2a.stats()
    want = np.array(rows[-WINDOW:])
    if s["CALLS"] != CALLS + replays:
        fails.append(f"CALLS {s['CALLS']}, expected {CALLS + replays}")
    if not np.array_equal(s["window"], want):
        fails.append(f"window differs from the routing's counts:\n{s['window'].tolist()}\n{want.tolist()}")
    if not np.array_equal(s["received"], received):
        fails.append(f"received {s['received'].tolist()}, expected {received.tolist()}")
    if s["DROPPED_PAIRS"] or s["MASKED_PAIRS"] or s["dropped"].any():
        fails.append("drops or masked pairs counted without capacity or masks")
    times = s["times_us"]
    if not times or len(times["dispatch"]) != WINDOW or len(times["combine"]) != WINDOW \
            or min(times["dispatch"] + times["combine"]) <= 0:
        fails.append(f"timing=True: expected {WINDOW} positive times per phase, got "
                     f"{ {k: len(v) for k, v in (times or {}).items()} }")
    plan = s["plan"]  # what the AllToAll launches: GPU transports only
    if (plan is None) != (transport == "host") or plan is not None and (
            set(plan["halves"]) != {"dispatch_send", "dispatch_recv", "combine_send", "combine_recv"}
            or plan["fallback"] or not all(k in plan["grids"] for ks in plan["whole"].values() for k in ks)):
        fails.append(f"stats()['plan'] on the {transport} transport: {plan}")
    checks += 6
    everyone = comm.allgather(s)
    for q, theirs in enumerate(everyone):
        for phase in ("dispatch", "combine"):
            if theirs["bytes"][f"{phase}_sent"][r] != s["bytes"][f"{phase}_received"][q] and q != r:
                fails.append(f"{phase}: rank {q} sent {theirs['bytes'][f'{phase}_sent'][r]} bytes here, this rank "
                             f"received {s['bytes'][f'{phase}_received'][q]}")
    want_bytes = records * RecordLayout.of(a2a.cfg).size  # one record per token and destination rank
    want_bytes[r] = 0
    if not np.array_equal(s["bytes"]["dispatch_sent"], want_bytes):
        fails.append(f"dispatch bytes sent {s['bytes']['dispatch_sent'].tolist()}, expected {want_bytes.tolist()}")
    summary = telemetry.from_stats(everyone)
    whole = np.concatenate([e["window"] for e in everyone], axis=1)
    if summary["expert"]["max"] != whole.max(axis=0).tolist() or summary["steps"] != WINDOW:
        fails.append("telemetry.from_stats disagrees with the gathered windows")
    checks += 3
    a2a.destroy()

    off = moecomm.AllToAll(comm, M, E, K, H, None, "fp16", "fp16", telemetry_window=0)
    run(xp, off, draw(W, 0), r, split=False)
    s = off.stats()
    if s["window"].shape != (0, L) or s["received"].any() or any(v.any() for v in s["bytes"].values()) \
            or s["CALLS"] != 1 or s["times_us"] is not None:
        fails.append("telemetry_window=0 kept a window, tokens or bytes")
    checks += 1
    off.destroy()
    checks += tags_and_gap(comm, xp, fails)
    finish(comm, fails, checks)


if __name__ == "__main__":
    main()
