"""Semantic sweep of AllToAll on any transport, run under MPI: every rank checks its own outputs.

    mpiexec -n 3 python tests/mpi_alltoall.py --transport host [--quick]
    mpirun -np 2 python tests/mpi_alltoall.py --transport nvshmem [--arrays cupy|torch|buffer]

Every rank draws the same global random data from the case seed, so each computes the reference
(moecomm.reference) locally and compares with what its transport produced: counts exactly, expert slots as
multisets of (token, scales) rows, combined tokens within float32-accumulation rounding of the output
dtype. Outputs are poisoned before every call. Exits non-zero on any mismatch; rank 0 prints a summary.
"""
import argparse
import itertools
import sys
import time

import numpy as np

import moecomm
from moecomm import reference
from moecomm._dtypes import _ALIASES, as_dtype, IN_DTYPES, OUT_DTYPES
from moecomm.alltoall import CombineArgs

POISON = 0xFF  # bytes of NaN in every float dtype we use; counts become -1


class Host:
    """Arrays for the host transport."""
    @staticmethod
    def put(a):
        return np.array(a)

    @staticmethod
    def get(a, dtype=None):
        return np.asarray(a) if dtype is None else np.asarray(a).view(dtype)

    @staticmethod
    def empty(shape, dtype):
        a = np.empty(shape, dtype)
        a.view(np.uint8).fill(POISON)
        return a

    @staticmethod
    def work():
        np.linalg.svd(np.ones((64, 64)))


class Device:
    """Arrays on the GPU (CuPy); dtypes CuPy lacks travel as raw bytes viewed by moecomm."""
    @staticmethod
    def _raw(dtype):
        dtype = np.dtype(dtype)
        return dtype if dtype.kind in "biuf" and dtype.name not in ("bfloat16", "float8_e4m3fn") \
            else np.dtype(f"u{dtype.itemsize}")

    @classmethod
    def put(cls, a):
        import cupy
        a = np.ascontiguousarray(a)
        return cupy.asarray(a.view(cls._raw(a.dtype)))

    @classmethod
    def get(cls, a, dtype=None):
        out = a.get()
        return out if dtype is None else out.view(dtype)

    @classmethod
    def empty(cls, shape, dtype):
        import cupy
        a = cupy.empty(shape, cls._raw(dtype))
        a.view(cupy.uint8).fill(POISON)
        return a

    @staticmethod
    def work():
        """A matrix product on the stream between a send and its receive (overlap)."""
        import cupy
        a = cupy.ones((2048, 2048), cupy.float32)
        (a @ a).sum()


class Torch(Device):
    """PyTorch tensors of the real dtypes (bf16, fp16, fp8 e4m3, int64, uint32, ...), passed as they are."""
    @staticmethod
    def _torch(dtype):
        import torch
        return getattr(torch, np.dtype(dtype).name)

    @classmethod
    def put(cls, a):
        import torch
        a = np.ascontiguousarray(a)
        return torch.from_numpy(a.view(cls._raw(a.dtype)).copy()).cuda().view(cls._torch(a.dtype))

    @staticmethod
    def get(t, dtype=None):
        import torch
        name = str(t.dtype).split(".")[1]
        out = t.contiguous().view(torch.uint8).cpu().numpy()
        return out.view(dtype if dtype is not None else (_ALIASES.get(name) or np.dtype(name)))

    @classmethod
    def empty(cls, shape, dtype):
        import torch
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        raw = torch.full((nbytes,), POISON, dtype=torch.uint8, device="cuda")
        return raw.view(cls._torch(dtype)).view(tuple(shape))

    @staticmethod
    def work():
        import torch
        a = torch.ones((2048, 2048), device="cuda")
        (a @ a).sum()


class Buffers(Device):
    """Raw moecomm.DeviceBuffers over CuPy memory (the pointer layer)."""
    @classmethod
    def put(cls, a):
        return cls._wrap(super().put(a), np.asarray(a).dtype)

    @classmethod
    def empty(cls, shape, dtype):
        return cls._wrap(super().empty(shape, dtype), dtype)

    @staticmethod
    def _wrap(c, dtype):
        return moecomm.DeviceBuffer(c.data.ptr, c.shape, np.dtype(dtype), c.data.device_id, c)

    @staticmethod
    def get(b, dtype=None):
        out = b.owner.get()
        return out if dtype is None else out.view(dtype)


def expert_fn(x, global_expert, out_dtype):
    """The 'expert': a row-wise function that depends on the expert, so misrouted outputs show."""
    return (x.astype(np.float32) * np.float32(1.0 + (global_expert % 7) / 8.0)).astype(out_dtype)


def expert_outputs(expert_x, counts, first_expert, out_dtype):
    """expert_fn over the filled slots of every local expert (empty slots stay zero)."""
    y = np.zeros(expert_x.shape, out_dtype)
    for le, n in enumerate(counts):
        y[le, :n] = expert_fn(expert_x[le, :n], first_expert + le, out_dtype)
    return y


def routing(rng, m, k, num_experts, world, rank, kind):
    if kind == "uniform":
        return np.argsort(rng.random((m, num_experts)), axis=1)[:, :k].astype(np.int32)
    if kind == "one_expert":  # every token goes to expert 0 (plus distinct others when k > 1)
        rest = np.argsort(rng.random((m, num_experts - 1)), axis=1)[:, :k - 1] + 1
        return np.concatenate([np.zeros((m, 1), np.int64), rest], axis=1).astype(np.int32)
    if kind == "other_rank":  # every token goes to experts of the next rank only
        local = num_experts // world
        base = ((rank + 1) % world) * local
        return (base + np.argsort(rng.random((m, local)), axis=1)[:, :k]).astype(np.int32)
    if kind == "holes":  # a third of the slots go nowhere (id -1), some tokens nowhere at all
        idx = routing(rng, m, k, num_experts, world, rank, "uniform")
        idx[rng.random(idx.shape) < 1 / 3] = -1
        idx[::5] = -1
        return idx
    raise ValueError(kind)


def random_tokens(rng, m, hidden, dtype):
    return (rng.standard_normal((m, hidden)) * 2).astype(np.float32).astype(dtype)


def run_case(comm, A, c, seed, tol):
    """One configuration, several calls with fresh data. Returns a list of failure strings."""
    W, rank = comm.world_size, comm.rank
    dp = c["dp_size"]
    G = W // dp
    in_dt, out_dt = as_dtype(c["in_dtype"], IN_DTYPES, "in"), as_dtype(c["out_dtype"], OUT_DTYPES, "out")
    E, K, H, S, M = c["num_experts"], c["topk"], c["hidden"], c["scale"], c["max_m"]
    L = E // W
    by_source = c.get("group_by_source", False)
    a2a = moecomm.AllToAll(comm, M, E, K, H, S, in_dt, out_dt, dp_size=dp, max_sms=c["max_sms"],
                           group_by_source=by_source)
    fails = []
    try:
        for it in range(c["iters"]):
            rng = np.random.default_rng([seed, it])
            ms = [int(v) for v in rng.integers(0, M + 1, G)] if c["m"] == "random" else [c["m"]] * G
            x = [random_tokens(rng, m, H, in_dt) for m in ms]
            xs = [rng.random((m, S), np.float32) if S else None for m in ms]
            idx = [routing(rng, m, K, E, G, g * dp, c["routing"]) for g, m in enumerate(ms)]
            w = [rng.random((m, K), np.float32) for m in ms]
            ref = reference.dispatch(x, xs if S else None, idx, E, W, M, dp)
            g = rank // dp
            m = ms[g]
            rows = M if it % 2 else m  # exact-size and padded inputs
            pad = lambda a, n=rows: np.concatenate([a, np.zeros((n - len(a),) + a.shape[1:], a.dtype)])
            bound_m = A.put(np.array([m], c.get("m_dtype", "int32")))
            idx_in = lambda a: A.put(pad(a).astype(c.get("idx_dtype", "int32")))  # -1 wraps to 0xffffffff
            out_n = A.empty((L,), np.int32)
            out_x = A.empty((L, M * G, H), in_dt)
            out_s = A.empty((L, M * G, S), np.float32) if S else None
            send_w = c["weights_at"] == "dispatch"
            dargs = (out_n, out_x, out_s, A.put(pad(x[g])), A.put(pad(xs[g])) if S else None,
                     idx_in(idx[g]), bound_m)
            # split: both phases as two halves (other work runs on the stream between them); "alternate": the
            # dispatch in even iterations, the combine in odd ones, so that each phase in one launch meets the
            # other's halves, the state one leaves being what the other starts from
            split_d = c["split"] is True or (c["split"] == "alternate" and it % 2 == 0)
            split_c = c["split"] is True or (c["split"] == "alternate" and it % 2 == 1)
            if split_d:
                a2a.dispatch(*dargs, do_send=True, do_recv=False, weights=A.put(pad(w[g])) if send_w else None)
                A.work()
                a2a.dispatch(*dargs, do_send=False, do_recv=True, weights=A.put(pad(w[g])) if send_w else None)
            else:
                a2a.dispatch(*dargs, weights=A.put(pad(w[g])) if send_w else None)
            a2a.synchronize()
            got_n = A.get(out_n).view(np.int32)
            got_x = A.get(out_x).view(in_dt)
            got_s = A.get(out_s).view(np.float32) if S else None
            r = ref[rank]
            if not np.array_equal(got_n, r["expert_num_tokens"]):
                fails.append(f"iter {it}: counts {got_n.tolist()} != {r['expert_num_tokens'].tolist()}")
                continue
            want_s = None if got_s is None else r["expert_x_scale"]
            for le in range(L):
                n = int(got_n[le])
                # group_by_source: each DP group's rows (its ranks' in rank order) where the reference has them
                origin = r["origin"][le, :n, 0]
                ranges = (zip(*[np.searchsorted(origin, np.unique(origin), side) for side in ("left", "right")])
                          if by_source else [(0, n)])
                for a, b in ranges:
                    part = lambda x, xs: [x[le, a:b], None if xs is None else xs[le, a:b]]
                    if not np.array_equal(reference.canonical_rows(b - a, *part(got_x, got_s)),
                                          reference.canonical_rows(b - a, *part(r["expert_x"], want_s))):
                        fails.append(f"iter {it}: expert {le} tokens differ from the reference"
                                     + (f" (rows {a}..{b - 1}: source group {origin[a]}'s)" if by_source else ""))
                        break
            # combine: expert outputs computed from what arrived, by the same row-wise function
            y = expert_outputs(got_x, got_n, rank * L, out_dt)
            ref_y = [expert_outputs(ref[q]["expert_x"], ref[q]["expert_num_tokens"], q * L, out_dt)
                     for q in range(W)]
            want = reference.combine(idx, w, ref_y, [q["origin"] for q in ref], E, W, out_dt)[g]
            out_t = A.empty((rows, H), out_dt)
            cw = None if send_w else A.put(pad(w[g]))
            # zero_tail (what moecomm.jax asks for): rows m..rows-1 of out_tokens become zeros; else left as they were
            cargs = CombineArgs(out_t, idx_in(idx[g]), cw, A.put(y), bound_m, zero_tail=c.get("zero_tail", False))
            if split_c:
                a2a.run(cargs, do_send=True, do_recv=False)
                A.work()
                a2a.run(cargs, do_send=False, do_recv=True)
            else:
                a2a.run(cargs)
            a2a.synchronize()
            got_t = A.get(out_t)
            if not (got_t.view(np.uint8)[m:rows] == (0 if cargs.zero_tail else POISON)).all():
                fails.append(f"iter {it}: combine rows {m}..{rows - 1} of out_tokens are not "
                             f"{'zeros' if cargs.zero_tail else 'as they were'}")
            got_t = got_t.view(out_dt)[:m].astype(np.float32)
            want = want.astype(np.float32)
            # error bound: a few roundings of the output dtype, relative to the sum of |terms|
            mag = reference.combine(idx, [np.abs(v) for v in w], [np.abs(v.astype(np.float32)) for v in ref_y],
                                    [q["origin"] for q in ref], E, W, np.float32)[g]
            bad = ~(np.abs(got_t - want) <= tol * mag + 1e-6)
            if bad.any():
                t, h = map(int, np.argwhere(bad)[0])
                fails.append(f"iter {it}: combine token {t} col {h}: {got_t[t, h]} != {want[t, h]} "
                             f"({int(bad.sum())} values off)")
    finally:
        a2a.destroy()
    return fails


def bad_input_case(comm, A):
    """A rank with a corrupted expert id: every rank raises InvalidRouting; the next call is correct."""
    W = comm.world_size
    E, K, H, M = 4 * W, 2, 64, 8
    a2a = moecomm.AllToAll(comm, M, E, K, H, None, "bfloat16", "bfloat16")
    fails = []
    try:
        rng = np.random.default_rng(7)
        x = random_tokens(rng, M, H, moecomm.bfloat16)
        idx = routing(rng, M, K, E, W, 0, "uniform")
        if comm.rank == W - 1:
            idx[3, 1] = E + 5
        outs = (A.empty((E // W,), np.int32), A.empty((E // W, M * W, H), moecomm.bfloat16), None)
        try:
            a2a.dispatch(*outs, A.put(x), None, A.put(idx), A.put(np.array([M], np.int32)))
            a2a.synchronize()
            fails.append("corrupted index: no error raised")
        except moecomm.InvalidRouting as e:
            if comm.rank == W - 1 and "token 3" not in str(e):
                fails.append(f"corrupted index: message does not name the token: {e}")
        # the call is over on every rank (a GPU rank's synchronize() finished it with no data): the next valid
        # call on the same AllToAll is correct
        good = [routing(np.random.default_rng([8, r]), M, K, E, W, r, "uniform") for r in range(W)]
        xs = [random_tokens(np.random.default_rng([9, r]), M, H, moecomm.bfloat16) for r in range(W)]
        a2a.dispatch(*outs, A.put(xs[comm.rank]), None, A.put(good[comm.rank]), A.put(np.array([M], np.int32)),
                     weights=A.put(np.ones((M, K), np.float32)))
        a2a.synchronize()
        ref = reference.dispatch(xs, None, good, E, W, M)[comm.rank]
        got_n, got_x = A.get(outs[0]).view(np.int32), A.get(outs[1]).view(moecomm.bfloat16)
        if not np.array_equal(got_n, ref["expert_num_tokens"]) or not all(
                np.array_equal(reference.canonical_rows(int(n), got_x[e]),
                               reference.canonical_rows(int(n), ref["expert_x"][e])) for e, n in enumerate(got_n)):
            fails.append("the valid dispatch after an invalid one differs from the reference")
        a2a.combine(A.empty((M, H), moecomm.bfloat16), A.put(good[comm.rank]), None,
                    A.empty((E // W, M * W, H), moecomm.bfloat16), A.put(np.array([M], np.int32)))
        a2a.synchronize()
        # a bad argument is refused before anything is sent, on this rank alone
        try:
            a2a.dispatch(*outs, A.put(x[:, :32]), None, A.put(idx), A.put(np.array([M], np.int32)))
            fails.append("wrong hidden size: no error raised")
        except moecomm.InvalidArgument:
            pass
    finally:
        a2a.destroy()
    return fails


def repeated_case(comm, mode, iters=20):
    """dispatch -> experts -> combine on the same arrays, with new data each time: captured once in a CUDA
    graph and replayed (``mode`` "graph"), or called eagerly with DeviceBuffers made once over two sets of
    arrays ("buffers": a call given the DeviceBuffers of its phase's last call is not read again), the sets
    taken in an irregular order so that calls meet both the other set and their own."""
    import cupy
    W, rank = comm.world_size, comm.rank
    E, K, H, M = 4 * W, 2, 512, 32
    L, dt = E // W, np.float16
    a2a = moecomm.AllToAll(comm, M, E, K, H, None, dt, dt)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:  # zeroed on the stream that reads them (a non-blocking stream does not wait for the null one)
        sets = [dict(x=cupy.zeros((M, H), dt), idx=cupy.zeros((M, K), np.int32), w=cupy.zeros((M, K), np.float32),
                     m=cupy.zeros(1, np.int32), n=cupy.zeros(L, np.int32), ex=cupy.zeros((L, M * W, H), dt),
                     y=cupy.zeros((L, M * W, H), dt), out=cupy.zeros((M, H), dt)) for _ in range(2)]
        factor = cupy.asarray(np.array([1.0 + ((rank * L + le) % 7) / 8.0 for le in range(L)], dt))[:, None, None]
    buffers = [{k: moecomm.DeviceBuffer(a.data.ptr, a.shape, a.dtype, comm.device, a) for k, a in d.items()}
               for d in sets]

    def step(d, b):  # b: what the calls are given (d's arrays, or DeviceBuffers over them)
        a2a.dispatch(b["n"], b["ex"], None, b["x"], None, b["idx"], b["m"], weights=b["w"], stream=stream)
        cupy.multiply(d["ex"], factor, out=d["y"])
        a2a.combine(b["out"], b["idx"], None, b["y"], b["m"], stream=stream)
    fails = []
    try:
        with stream:
            step(sets[0], sets[0])  # warm-up (eager)
            stream.synchronize()
            a2a.synchronize(stream)
            if mode == "graph":
                stream.begin_capture(cupy.cuda.runtime.streamCaptureModeRelaxed)
                step(sets[0], sets[0])
                graph = stream.end_capture()
            for it in range(iters):
                which = 0 if mode == "graph" else (0, 0, 1, 0, 1, 1)[it % 6]
                d = sets[which]
                rng = np.random.default_rng([77, it])
                ms = [int(v) for v in rng.integers(0, M + 1, W)]
                x = [random_tokens(rng, m, H, dt) for m in ms]
                idx = [routing(rng, m, K, E, W, r, "uniform") for r, m in enumerate(ms)]
                w = [rng.random((m, K), np.float32) for m in ms]
                m = ms[rank]
                d["x"][:m], d["idx"][:m], d["w"][:m], d["m"][0] = cupy.asarray(x[rank]), cupy.asarray(idx[rank]), \
                    cupy.asarray(w[rank]), m
                d["out"].fill(np.nan)
                if mode == "graph":
                    graph.launch(stream)
                else:
                    step(d, buffers[which])
                stream.synchronize()
                a2a.synchronize(stream)
                ref = reference.dispatch(x, None, idx, E, W, M)
                ref_y = [expert_outputs(r["expert_x"], r["expert_num_tokens"], q * L, dt)
                         for q, r in enumerate(ref)]
                want = reference.combine(idx, w, ref_y, [r["origin"] for r in ref], E, W, dt)[rank]
                got = d["out"][:m].get()
                if not np.array_equal(d["n"].get(), ref[rank]["expert_num_tokens"]):
                    fails.append(f"{mode} call {it}: counts differ")
                elif not np.allclose(got.astype(np.float32), want.astype(np.float32), rtol=2 ** -9, atol=1e-3):
                    fails.append(f"{mode} call {it}: combined tokens differ")
    finally:
        a2a.destroy()
    return fails


def cases(world, quick):
    base = dict(in_dtype="bfloat16", out_dtype="bfloat16", hidden=256, scale=None, num_experts=4 * world,
                topk=2, max_m=16, m="random", routing="uniform", dp_size=1, weights_at="dispatch",
                split=False, iters=3, max_sms=None)
    out = []
    for in_dt, out_dt in itertools.product(["bfloat16", "float16", "float8_e4m3fn"], ["bfloat16", "float16"]):
        out.append(dict(base, in_dtype=in_dt, out_dtype=out_dt,
                        scale=(base["hidden"] // 128 if in_dt == "float8_e4m3fn" else None)))
    for k in ([1, 6, 8] if not quick else [1, 8]):
        out.append(dict(base, topk=k, num_experts=8 * world))
    for kind in ("one_expert", "other_rank"):
        out.append(dict(base, routing=kind, topk=2))
    out.append(dict(base, m=0))
    out.append(dict(base, m=16))
    out.append(dict(base, idx_dtype="int64"))  # DeepEP / torch.topk ids
    out.append(dict(base, idx_dtype="uint32", m_dtype="uint32"))  # pplx-kernels / vLLM
    out.append(dict(base, routing="holes"))
    out.append(dict(base, routing="holes", idx_dtype="int64", weights_at="combine"))
    out.append(dict(base, routing="holes", idx_dtype="uint32", split=True, topk=4, num_experts=8 * world))
    out.append(dict(base, weights_at="combine"))
    out.append(dict(base, split=True))
    out.append(dict(base, split="alternate", iters=4))
    out.append(dict(base, split="alternate", iters=4, weights_at="combine", routing="holes"))
    out.append(dict(base, zero_tail=True, iters=4))
    out.append(dict(base, zero_tail=True, split=True, weights_at="combine", iters=4))
    out.append(dict(base, group_by_source=True, routing="holes", iters=4))  # DeepEP's layout
    out.append(dict(base, group_by_source=True, split="alternate", in_dtype="float8_e4m3fn", scale=2, iters=4))
    # grids capped at the fewest SMs the world size allows (max_sms: 2 blocks per SM, a block per rank; the host
    # transport has no grids) and one more: a block takes many tokens, so at 512 tokens records stream and the
    # one-launch phases run on a few blocks
    fewest = -(-world // 2)
    out.append(dict(base, max_sms=fewest, split=True))
    out.append(dict(base, max_sms=fewest + 1, max_m=512, m=512, iters=2))
    out.append(dict(base, max_sms=fewest + 1, max_m=512, m=512, iters=2, group_by_source=True))
    out.append(dict(base, split=True, weights_at="combine", in_dtype="float8_e4m3fn", scale=7))
    out.append(dict(base, hidden=2048, scale=16, in_dtype="float8_e4m3fn", topk=8, num_experts=8 * world))
    for dp in range(2, world + 1):
        if world % dp == 0:
            out.append(dict(base, dp_size=dp))
            out.append(dict(base, dp_size=dp, weights_at="combine"))
    out.append(dict(base, iters=50 if quick else 200, max_m=8, hidden=64))  # repeated calls, same buffers
    return out


def gpu_cases(world, quick):
    """Model-sized configurations for the GPU transport (the reference is slow in Python: few iterations).
    With ``quick``, only the DeepSeek-R1-sized ones."""
    base = dict(in_dtype="float8_e4m3fn", out_dtype="bfloat16", hidden=7168, scale=56, num_experts=256,
                topk=8, max_m=128, m="random", routing="uniform", dp_size=1, weights_at="dispatch",
                split=False, iters=2, max_sms=None)
    out = [base, dict(base, m=128), dict(base, weights_at="combine"), dict(base, split=True),
           dict(base, split="alternate"),
           dict(base, routing="one_expert"), dict(base, routing="other_rank"), dict(base, m=0),
           dict(base, in_dtype="bfloat16", scale=None, out_dtype="float16"),
           # a prefill-sized batch: the one-launch dispatch's sending blocks hold more than STREAM_TOKENS tokens,
           # so rows carry arrival words and are taken as they land (moecomm.transport.gpu_plan.streamed):
           # dispatch records, and on ipc the combine's partial sums (weights at dispatch), summed with this
           # rank's own expert rows
           dict(base, hidden=512, scale=4, max_m=2048, m=2048, iters=1), dict(base, hidden=512, scale=4, max_m=2048),
           dict(base, hidden=512, scale=4, max_m=2048, m=2048, routing="other_rank", iters=1),
           dict(base, hidden=512, scale=4, max_m=2048, m=2048, weights_at="combine", iters=1),
           dict(base, zero_tail=True, iters=4), dict(base, hidden=512, scale=4, max_m=2048, zero_tail=True),
           dict(base, group_by_source=True, split=True),
           dict(base, hidden=512, scale=4, max_m=2048, m=2048, iters=1, group_by_source=True)]
    if world % 2 == 0:  # the same in DP groups of two (2048 tokens per rank)
        out.append(dict(base, hidden=256, scale=2, max_m=4096, m=4096, dp_size=2, iters=1))
    if quick:
        return out
    for hidden, experts, k in ((2048, 64, 6), (4096, 8, 2), (2048, 8, 1), (4096, 64, 8)):
        for in_dt in ("bfloat16", "float16", "float8_e4m3fn"):
            out.append(dict(base, hidden=hidden, num_experts=max(experts, world), topk=k, in_dtype=in_dt,
                            scale=hidden // 128 if in_dt == "float8_e4m3fn" else None, max_m=64))
    out.append(dict(base, hidden=2048, num_experts=64, topk=6, max_m=8, scale=16, iters=1000))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--transport", default="auto")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--full", action="store_true", help="add model-sized cases (GPU runs)")
    p.add_argument("--dp-only", action="store_true", help="only the cases with DP groups (dp_size > 1)")
    p.add_argument("--arrays", default="cupy", choices=["cupy", "torch", "buffer"],
                   help="what the GPU transport is given: CuPy arrays, PyTorch tensors or DeviceBuffers")
    args = p.parse_args()
    comm = moecomm.init(transport=args.transport)
    A = Host if comm.transport.memory == "host" else {"cupy": Device, "torch": Torch, "buffer": Buffers}[args.arrays]
    if A is Torch:
        import torch
        torch.cuda.set_device(comm.device)
    # float32 accumulation in another order, then one rounding to the output dtype: within 2 ulp.
    tol = {"bfloat16": 2 ** -6, "float16": 2 ** -9}
    failures, t0 = [], time.time()
    all_cases = cases(comm.world_size, args.quick) + (gpu_cases(comm.world_size, args.quick) if args.full else [])
    if args.dp_only:
        all_cases = [c for c in all_cases if c["dp_size"] > 1]
    for i, c in enumerate(all_cases):
        for f in run_case(comm, A, c, seed=1000 + i, tol=tol[c["out_dtype"]]):
            failures.append(f"rank {comm.rank} case {c}: {f}")
    failures += [f"rank {comm.rank} bad input: {f}" for f in bad_input_case(comm, A)]
    if A is not Host:
        for mode in ("graph", "buffers"):
            failures += [f"rank {comm.rank} {mode}: {f}" for f in repeated_case(comm, mode)]
    comm.check_peers()
    everyone = comm.allgather(failures)
    comm.finalize()
    if comm.rank == 0:
        flat = [f for fs in everyone for f in fs]
        for f in flat[:20]:
            print("FAIL", f)
        cases_run = len(all_cases) + (1 if A is Host else 3)  # + bad input, graph and buffers
        print(f"{cases_run} cases on {len(everyone)} ranks ({args.transport}, {A.__name__}): "
              f"{len(flat)} failures in {time.time() - t0:.1f} s")
    sys.exit(1 if any(everyone) else 0)


if __name__ == "__main__":
    main()
