"""The ranks layout (``AllToAll(layout="ranks")``, DeepEP's normal mode): each token once per rank that owns any of
its experts, rows grouped by source rank in token order. Dispatch's rows, scales (row- and column-major), offsets,
pair counts and AllToAll.row_routing equal moecomm.reference.dispatch_by_rank's for bf16 tokens, FP8 tokens with
their scales and a quantising dispatch (e4m3 + float32 scales), with and without weights, tokens routed nowhere
included; a second dispatch of the same routing places every row alike (a cached dispatch); combine sums each
token's rows over the ranks (reference.combine_by_rank), and the float32 side rows the same way; refusals
(weights at combine, side rows halved, side rows in the padded layout) raise InvalidArgument on every rank and the
next call is right. On GPUs the same, with CuPy arrays.

    mpiexec -n 3 python tests/mpi_ranks.py                       # host transport (numpy)
    mpirun -n 2 python tests/mpi_ranks.py --transport nvshmem    # GPUs

Prints "<n> checks on <w> ranks: <f> failures" on rank 0.
"""
import argparse
from typing import NamedTuple

import numpy as np

import moecomm
from moecomm import reference
from report import finish

E_PER_RANK, K, H, M = 4, 3, 256, 10
FORMATS = (  # (name, in_dtype, scales a token, AllToAll options)
    ("bf16", moecomm.bfloat16, None, {}),
    ("e4m3 row scales", moecomm.float8_e4m3fn, 8, {}),
    ("e4m3 column scales", moecomm.float8_e4m3fn, 8, dict(scale_layout="column")),
    ("quantising dispatch", moecomm.bfloat16, None, dict(dispatch_wire="e4m3")),
)


def draw(W, seed, dt, scales, m=M):
    """Every rank's (x [m, H], scales or None, weights [m, K], ids [m, K]) from one seed: some ids -1, one token
    routed nowhere, one to a single rank."""
    E = E_PER_RANK * W
    out = []
    for q in range(W):
        rng = np.random.default_rng([seed, q])
        x = rng.standard_normal((m, H)).astype(np.float32).astype(dt)
        xs = rng.random((m, scales), np.float32) + 0.5 if scales else None
        ids = np.argsort(rng.random((m, E)), axis=1)[:, :K].astype(np.int32)
        ids[rng.random((m, K)) < 0.2] = -1
        ids[0] = -1
        ids[1] = [q * E_PER_RANK % E] + [-1] * (K - 1)
        out.append((x, xs, rng.random((m, K), np.float32), ids))
    return out


def put(xp, a):
    """An array on the transport's side: numpy, or CuPy (raw bytes for dtypes CuPy lacks)."""
    if a is None or xp is np:
        return a
    return xp.asarray(a.view(f"u{a.dtype.itemsize}") if a.dtype.name in ("bfloat16", "float8_e4m3fn") else a)


def get(a, dtype):
    """A numpy array of ``dtype`` from either side (None stays None)."""
    return None if a is None else (a.get() if hasattr(a, "get") else a).view(dtype)


class Call:
    """One rank's outputs of a dispatch in the ranks layout (``xp``: numpy or CuPy), made once for an AllToAll;
    after :meth:`dispatch`, ``got`` holds them as numpy arrays."""

    def __init__(self, a2a, xp):
        c, self.xp = a2a.cfg, xp
        self.n = xp.zeros(c.num_local_experts, np.int32)
        self.x = put(xp, np.zeros(c.expert_x_shape(), c.expert_dtype))
        self.xs = None if c.hidden_dim_scale is None else xp.zeros(c.expert_x_scale_shape(), c.scale_dtype)
        self.offsets = xp.zeros(c.world_size + 1, np.int32)
        self.ids = xp.zeros((c.expert_capacity, c.experts_per_token), np.int64)
        self.w = xp.zeros((c.expert_capacity, c.experts_per_token), np.float32)

    def dispatch(self, a2a, x, xs, ids, weights, m):
        xp, c = self.xp, a2a.cfg
        m = xp.asarray(np.array([m], np.int32))
        a2a.dispatch(self.n, self.x, self.xs, put(xp, x), put(xp, xs), put(xp, ids), m, weights=put(xp, weights),
                     out_expert_offsets=self.offsets)
        a2a.row_routing(self.ids, self.w)
        a2a.synchronize() if xp is not np else None
        self.got = Got(get(self.n, np.int32), get(self.x, c.expert_dtype), get(self.xs, c.scale_dtype),
                       get(self.offsets, np.int32), get(self.ids, np.int64), get(self.w, np.float32))


class Got(NamedTuple):
    """A dispatch's outputs as numpy arrays."""
    n: object
    x: object
    xs: object
    offsets: object
    ids: object
    w: object


def check_dispatch(a2a, call, drawn, with_weights, fails, label):
    """Rows, scales, offsets, counts and row_routing against reference.dispatch_by_rank; returns the reference."""
    c, r, got = a2a.cfg, a2a.cfg.rank, call.got
    x = [d[0] for d in drawn]
    xs = [d[1] for d in drawn] if c.hidden_dim_scale and c.dispatch_wire is None else None
    if c.dispatch_wire is not None:  # the tokens as quantised on the sending rank (bit for bit)
        quantised = [reference.quantize_tokens(t, c.dispatch_wire, c.scale_dtype) for t in x]
        x, xs = [q[0] for q in quantised], [q[1] for q in quantised]
    want = reference.dispatch_by_rank(x, xs, [d[3] for d in drawn], [d[2] for d in drawn] if with_weights else None,
                                      c.num_experts, c.world_size)[r]
    n = len(want["rows"])
    scales = None if got.xs is None else got.xs[:, :n].T if c.scale_layout == "column" else got.xs[:n]
    checks = (("offsets", got.offsets, want["offsets"]), ("pair counts", got.n, want["expert_num_tokens"]),
              ("rows", got.x[:n].view(np.uint8), want["rows"].view(np.uint8)),
              ("scales", scales, want["scales"]), ("row_routing ids", got.ids[:n], want["indices"]),
              ("row_routing weights", got.w[:n], want["weights"]),
              ("ids past the rows (-1)", got.ids[n:], np.full_like(got.ids[n:], -1)))
    for what, a, b in checks:
        if (a is None) != (b is None) or a is not None and not np.array_equal(a, b):
            fails.append(f"{label}: {what} differ from the reference's")
            break
    return want


def check_combine(a2a, comm, call, want, drawn, fails, label):
    """Combine of rows made from the received ones (row i's expert output (i + 1) / n, in bf16) with the row_routing
    weights as side rows: each token's sum over ranks, in float32."""
    c, W, xp = a2a.cfg, comm.world_size, call.xp
    n = len(want["rows"])
    y = np.zeros((c.expert_capacity, H), moecomm.bfloat16)
    y[:n] = (np.arange(1, n + 1, dtype=np.float32)[:, None] / n).astype(moecomm.bfloat16)
    out, out_w = put(xp, np.full((M, H), np.nan, moecomm.bfloat16)), xp.full((M, K), np.nan, np.float32)
    a2a.combine(out, put(xp, drawn[c.rank][3]), None, put(xp, y), xp.asarray(np.array([M], np.int32)),
                expert_weights=call.w, out_weights=out_w)
    a2a.synchronize() if xp is not np else None
    everyone = comm.allgather((y[:n], call.got.w[:n], want["origin"]))
    sums = reference.combine_by_rank([e[0] for e in everyone], [e[2] for e in everyone], [M] * W,
                                     moecomm.bfloat16)[c.rank]
    side = reference.combine_by_rank([e[1] for e in everyone], [e[2] for e in everyone], [M] * W)[c.rank]
    if not np.array_equal(get(out, np.uint16), sums.view(np.uint16)):
        fails.append(f"{label}: combine's sums over ranks differ from the reference's")
    if not np.allclose(get(out_w, np.float32), side, rtol=1e-6, atol=0):
        fails.append(f"{label}: combine's float32 side rows differ from the reference's")


def refused(a2a, xp, fails, label, **bad):
    """A combine given ``bad`` arguments (numpy; put on ``xp``'s side) raises InvalidArgument here and PeerError on
    the peers (every rank gives the same), its call over; the caller's next call must be right."""
    c = a2a.cfg
    args = dict(out_tokens=np.zeros((M, H), moecomm.bfloat16), indices=np.full((M, K), -1, np.int32), weights=None,
                expert_y=np.zeros((c.expert_capacity, H), moecomm.bfloat16), bound_m=np.array([M], np.int32))
    args.update(bad)
    args = {k: put(xp, v) for k, v in args.items()}
    try:
        a2a.combine(**args)
        fails.append(f"{label}: accepted")
    except (moecomm.InvalidArgument, moecomm.PeerError):
        pass


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--transport", default="host")
    transport = p.parse_args().transport
    comm = moecomm.init(transport=transport, timeout=5.0 if transport == "host" else 30.0)
    W, fails, checks = comm.world_size, [], 0
    E = E_PER_RANK * W
    xp = np
    if transport != "host":
        import cupy as xp
    for name, dt, scales, options in FORMATS:
        a2a = moecomm.AllToAll(comm, M, E, K, H, scales, dt, "bf16", layout="ranks", **options)
        got = Call(a2a, xp)
        for seed in range(2):
            drawn = draw(W, seed, dt, scales)
            x, xs, w, ids = drawn[comm.rank]
            with_weights = seed == 0
            label = f"{name} seed {seed}{'' if with_weights else ' no weights'}"
            got.dispatch(a2a, x, xs, ids, w if with_weights else None, M)
            want = check_dispatch(a2a, got, drawn, with_weights, fails, label)
            a2a.abort()  # no combine for this one: the same routing dispatched again places every row alike
            got.dispatch(a2a, x, xs, ids, w if with_weights else None, M)
            check_dispatch(a2a, got, drawn, with_weights, fails, f"{label}, dispatched again")
            check_combine(a2a, comm, got, want, drawn, fails, label)
            checks += 3
        a2a.destroy()
    a2a = moecomm.AllToAll(comm, M, E, K, H, None, "bf16", "bf16", layout="ranks")
    got = Call(a2a, xp)
    c = a2a.cfg
    side = dict(expert_weights=np.zeros((c.expert_capacity, K), np.float32),
                out_weights=np.zeros((M, K), np.float32))
    for label, bad in (("weights at combine", dict(weights=np.ones((M, K), np.float32))),
                       ("side rows halved", dict(expert_weights=side["expert_weights"])),
                       ("side rows of the wrong shape", dict(side, out_weights=np.zeros((M, K + 1), np.float32)))):
        drawn = draw(W, 7, moecomm.bfloat16, None)
        got.dispatch(a2a, drawn[comm.rank][0], None, drawn[comm.rank][3], None, M)
        refused(a2a, xp, fails, label, indices=drawn[comm.rank][3], **bad)
        got.dispatch(a2a, drawn[comm.rank][0], None, drawn[comm.rank][3], drawn[comm.rank][2], M)
        want = check_dispatch(a2a, got, drawn, True, fails, f"after {label}")
        check_combine(a2a, comm, got, want, drawn, fails, f"after {label}")
        checks += 2
    try:
        a2a.plan(moecomm.RoutingPlan(*[xp.zeros(s, np.int32) for s in a2a.plan_shapes()]))
        fails.append("plan in the ranks layout: accepted")
    except moecomm.InvalidArgument:
        pass
    a2a.destroy()
    padded = moecomm.AllToAll(comm, M, E, K, H, None, "bf16", "bf16")
    try:
        padded.combine(put(xp, np.zeros((M, H), moecomm.bfloat16)), put(xp, np.full((M, K), -1, np.int32)), None,
                       put(xp, np.zeros(padded.cfg.expert_x_shape(), moecomm.bfloat16)),
                       put(xp, np.array([M], np.int32)), expert_weights=put(xp, side["expert_weights"]),
                       out_weights=put(xp, side["out_weights"]))
        fails.append("side rows in the padded layout: accepted")
    except moecomm.InvalidArgument:
        pass
    padded.destroy()
    for bad in (dict(capacity=4), dict(group_by_source=True), dict(combine_wire="e4m3")):
        try:
            moecomm.AllToAll(comm, M, E, K, H, None, "bf16", "bf16", layout="ranks", **bad)
            fails.append(f"layout='ranks' with {bad}: constructed")
        except moecomm.InvalidArgument:
            pass
    checks += 5
    finish(comm, fails, checks)


if __name__ == "__main__":
    main()
