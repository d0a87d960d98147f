"""Formats of the wire on any transport: every scale format (float32, UE8M0 one per byte, UE8M0 packed
four per int32) in either scale layout (row-major, column-major per expert) and either expert layout
round-trips bit-exactly through dispatch; an NVFP4-shaped opaque payload (uint8 rows: packed 4-bit values,
their e4m3 scales, a float32 global scale) does too, and combine stays typed; the FP8 combine wire ("e4m3",
"e4m3_ue8m0", weights sent with dispatch or given at combine) equals the reference's rounding, stays within
the stated bound of the exact result, and sends fewer bytes than the bf16 path; a quantising dispatch
(dispatch_wire "e4m3" / "e4m3_ue8m0", bf16 and fp16 tokens, every scale format and layout) lands exactly the
reference's e4m3 values and scales (moecomm.reference.quantize_tokens).

    mpiexec -n 3 python tests/mpi_formats.py [--transport host|ipc|nvshmem]

Prints "<n> checks on <w> ranks: <f> failures" on rank 0.
"""
import argparse

import numpy as np

import moecomm
from moecomm import reference
from moecomm._dtypes import float8_e8m0fnu
from mpi_alltoall import Device, Host
from report import finish

A = Host  # the arrays of the transport under test (main)

E_PER_RANK, K, M, H = 3, 2, 12, 512
WIDE_H = 9216  # a bf16 row of 1152 16-byte chunks: more than the 1024 a block's 256 threads load in one round
SCALES = (  # (scale_dtype, scales per token): blocks of 128 in float32, of 32 in UE8M0, UE8M0 packed by four
    ("float32", H // 128), ("ue8m0", H // 32), ("ue8m0x4", H // 32 // 4))
NVFP4_BYTES = H // 2 + H // 16 + 4  # 4-bit values, an e4m3 scale per 16 values, a float32 global scale
NVFP4_ROW = -(-NVFP4_BYTES // 16) * 16


def draw(W, seed, row_bytes=None, hidden=H):
    """Per rank: tokens (bf16 [M, hidden], or opaque rows of ``row_bytes``), ids (some -1), weights."""
    E = E_PER_RANK * W
    out = []
    for q in range(W):
        rng = np.random.default_rng([seed, q])
        x = (rng.integers(0, 256, (M, row_bytes), np.uint8) if row_bytes else
             rng.standard_normal((M, hidden)).astype(np.float32).astype(moecomm.bfloat16))
        ids = np.argsort(rng.random((M, E)), axis=1)[:, :K].astype(np.int32)
        ids[rng.random((M, K)) < 0.1] = -1
        out.append((x, ids, rng.random((M, K), np.float32)))
    return out


def random_scales(W, seed, dtype, n):
    """Per rank [M, n] scales of ``dtype`` with every byte pattern it may hold (UE8M0: any exponent byte but
    0xff, its NaN)."""
    out = []
    for q in range(W):
        rng = np.random.default_rng([seed, 100 + q])
        if dtype == "float32":
            out.append(rng.standard_normal((M, n)).astype(np.float32))
        elif dtype == "ue8m0":
            out.append(rng.integers(0, 255, (M, n), np.uint8).view(float8_e8m0fnu))
        else:
            out.append(rng.integers(0, 255, (M, n * 4), np.uint8).view(np.int32))
    return out


def dispatch(a2a, x, xs, ids, w, weights_at_dispatch=True):
    """One dispatch into poisoned outputs: (counts, expert_x, expert scales or None, offsets or None) as numpy
    arrays, and expert_x where the transport keeps it (for a combine)."""
    c = a2a.cfg
    n = A.empty(c.num_local_experts, np.int32)
    ex = A.empty(c.expert_x_shape(), c.expert_dtype)
    es = None if c.hidden_dim_scale is None else A.empty(c.expert_x_scale_shape(), c.scale_dtype)
    off = A.empty(c.num_local_experts + 1, np.int32) if c.layout == "packed" else None
    a2a.dispatch(n, ex, es, A.put(x), None if xs is None else A.put(xs), A.put(ids), A.put(np.array([M], np.int32)),
                 weights=A.put(w) if weights_at_dispatch else None, out_expert_offsets=off)
    got = [None if a is None else A.get(a).view(dtype) for a, dtype in
           ((n, np.int32), (ex, c.expert_dtype), (es, c.scale_dtype), (off, np.int32))]
    return (*got, ex)


def combine(a2a, ids, w, y):
    """One combine of expert outputs ``y`` (kept by the transport, or numpy) into poisoned rows: numpy."""
    out = A.empty((M, a2a.cfg.hidden_dim), a2a.cfg.out_dtype)
    a2a.combine(out, A.put(ids), None if w is None else A.put(w), A.put(y) if isinstance(y, np.ndarray) else y,
                A.put(np.array([M], np.int32)))
    return A.get(out).view(a2a.cfg.out_dtype)


def padded(a, off, cap):
    """A packed layout's [rows, ...] as the padded one's [L, cap, ...]."""
    out = np.zeros((len(off) - 1, cap) + a.shape[1:], a.dtype)
    for e in range(len(off) - 1):
        out[e, :off[e + 1] - off[e]] = a[off[e]:off[e + 1]]
    return out


def against_reference(fails, label, got, ref, scale_layout, W):
    """A dispatch's (counts, expert_x, scales, offsets or None) against the reference's rank dict: counts equal,
    each expert's rows and scales the same bytes (slots compared as sets: the host transport keeps the reference's
    order, but the comparison does not rely on it)."""
    n, ex, es, off = got
    rows = es if scale_layout == "row" else np.swapaxes(es, -1, -2)  # [.., slots, scales]
    if off is not None:  # packed
        ex, rows = padded(ex, off, M * W), padded(np.ascontiguousarray(rows), off, M * W)
    if not np.array_equal(n, ref["expert_num_tokens"]):
        fails.append(f"{label}: counts {n.tolist()} != {ref['expert_num_tokens'].tolist()}")
    for e in range(E_PER_RANK):
        mine = reference.canonical_rows(n[e], ex[e], np.ascontiguousarray(rows[e]))
        if not np.array_equal(mine, reference.canonical_rows(n[e], ref["expert_x"][e], ref["expert_x_scale"][e])):
            fails.append(f"{label}: expert {e}'s rows and scales are not the reference's bytes")


def check_scales(comm, fails):
    """Scales and tokens bit-exact against the reference."""
    W, r, checks = comm.world_size, comm.rank, 0
    E = E_PER_RANK * W
    for dtype, n_scales in SCALES:
        for scale_layout in ("row", "column"):
            for layout in ("padded", "packed"):
                label = f"scales {dtype} {scale_layout}-major, {layout}"
                a2a = moecomm.AllToAll(comm, M, E, K, H, n_scales, "bf16", "bf16", scale_dtype=dtype,
                                       layout=layout, scale_layout=scale_layout)
                drawn, scales = draw(W, checks), random_scales(W, checks, dtype, n_scales)
                x, ids, w = drawn[r]
                *got, kept = dispatch(a2a, x, scales[r], ids, w)
                combine(a2a, ids, None, kept)
                ref = reference.dispatch([d[0] for d in drawn], scales, [d[1] for d in drawn], E, W, M)[r]
                against_reference(fails, label, got, ref, scale_layout, W)
                a2a.destroy()
                checks += 1
    return checks


def check_opaque(comm, fails):
    """NVFP4-shaped rows of bytes through dispatch, bit-exactly; combine of typed expert outputs."""
    W, r = comm.world_size, comm.rank
    E = E_PER_RANK * W
    a2a = moecomm.AllToAll(comm, M, E, K, NVFP4_ROW, None, "uint8", "bf16")
    drawn = draw(W, 7, NVFP4_ROW)
    x, ids, w = drawn[r]
    n, ex, _, _, _ = dispatch(a2a, x, None, ids, w)
    ref = reference.dispatch([d[0] for d in drawn], None, [d[1] for d in drawn], E, W, M)
    for e in range(E_PER_RANK):
        if not np.array_equal(reference.canonical_rows(n[e], ex[e]),
                              reference.canonical_rows(n[e], ref[r]["expert_x"][e])):
            fails.append(f"opaque NVFP4 rows: expert {e}'s rows are not the reference's bytes")
    # the experts: a typed output from the bytes (the first NVFP4_ROW values as numbers)
    y = (ex.astype(np.float32) / 255)[..., :NVFP4_ROW].astype(moecomm.bfloat16)
    out = combine(a2a, ids, None, y)
    ref_y = [(q["expert_x"].astype(np.float32) / 255).astype(moecomm.bfloat16) for q in ref]
    want = reference.combine([d[1] for d in drawn], [d[2] for d in drawn], ref_y, [q["origin"] for q in ref], E, W,
                             moecomm.bfloat16)[r]
    if not np.allclose(out.astype(np.float32), want.astype(np.float32), rtol=2 ** -7, atol=1e-2):
        fails.append("opaque NVFP4 rows: combine of typed outputs differs from the reference")
    a2a.destroy()
    return 2


def check_fp8_combine(comm, fails):
    """The FP8 combine wire against the reference's rounding and the exact result, and its bytes."""
    W, r, checks = comm.world_size, comm.rank, 0
    E = E_PER_RANK * W
    sent = {}
    for wire in (None, "e4m3", "e4m3_ue8m0"):
        for partials in (True, False):
            label = f"combine_wire {wire} weights {'sent with dispatch' if partials else 'at combine'}"
            a2a = moecomm.AllToAll(comm, M, E, K, H, None, "bf16", "bf16", combine_wire=wire)
            drawn = draw(W, 20 + partials)
            x, ids, w = drawn[r]
            n, ex, _, _, _ = dispatch(a2a, x, None, ids, w, weights_at_dispatch=partials)
            scale = np.exp(np.linspace(-3, 3, H, dtype=np.float32))  # values across many binades
            y = (ex.astype(np.float32) * scale).astype(moecomm.bfloat16)
            out = combine(a2a, ids, None if partials else w, y)
            sent[(wire, partials)] = int(a2a.stats()["bytes"]["combine_sent"].sum())
            ref = reference.dispatch([d[0] for d in drawn], None, [d[1] for d in drawn], E, W, M)
            ys = [(q["expert_x"].astype(np.float32) * scale).astype(moecomm.bfloat16) for q in ref]
            args = ([d[1] for d in drawn], [d[2] for d in drawn], ys, [q["origin"] for q in ref], E, W)
            want = reference.combine(*args, moecomm.bfloat16, wire=wire, partials=partials)[r].astype(np.float32)
            got = out.astype(np.float32)
            if not np.allclose(got, want, rtol=2 ** -7, atol=1e-6):
                fails.append(f"{label}: differs from the reference's rounding (max {np.abs(got - want).max():.3g})")
            exact = reference.combine(*args, np.float32)[r]
            size = reference.combine(args[0], [np.abs(d[2]) for d in drawn],
                                     [np.abs(v.astype(np.float32)) for v in ys], *args[3:], np.float32)[r]
            peak = reference.combine(args[0], [np.abs(d[2]) for d in drawn],  # sum_k |w| max |y_k|, per token
                                     [np.broadcast_to(np.abs(v.astype(np.float32)).max(-1, keepdims=True), v.shape)
                                      for v in ys], *args[3:], np.float32)[r]
            # e4m3: 2^-4 of each value, or below its normal range scale * 2^-10 (scale <= peak / 448); without a
            # wire, GPU transports send partial sums in bf16 (2^-8 each); then the result's bf16
            bound = (2 ** -4 * size + peak / 448 * 2 ** -10 if wire else 2 ** -8 * size if partials else 0) \
                + 2 ** -8 * np.abs(exact) + 1e-6
            if (np.abs(got - exact) > bound).any():
                fails.append(f"{label}: beyond the stated bound of the exact sum")
            a2a.destroy()
            checks += 2
    if W > 1:
        for partials in (True, False):
            if not sent[("e4m3", partials)] < sent[(None, partials)]:
                fails.append(f"FP8 combine wire: {sent[('e4m3', partials)]} bytes sent, bf16 path "
                             f"{sent[(None, partials)]}")
        checks += 1
    return checks


def check_quantising_dispatch(comm, fails):
    """dispatch_wire: bf16 / fp16 tokens quantised by the sender, bit-exactly the reference's values and scales in
    every scale format and layout; values across many binades, a block of zeros and one below e4m3's normal range
    in every token. Rows of H values, and one case of WIDE_H: more source chunks than a block's threads hold in
    their first round of loads."""
    W, r, checks = comm.world_size, comm.rank, 0
    E = E_PER_RANK * W
    cases = [("e4m3", "float32")] + [("e4m3_ue8m0", d) for d in ("float32", "ue8m0", "ue8m0x4")]
    layouts = (("row", "padded"), ("column", "padded"), ("row", "packed"))
    runs = [(case, dt, sl, lay, H) for case in cases for dt in ("bf16", "fp16") for sl, lay in layouts]
    runs.append((cases[0], "bf16", "row", "padded", WIDE_H))
    for (wire, scale_dtype), in_dtype, scale_layout, layout, hidden in runs:
        label = (f"dispatch_wire {wire} {in_dtype} scales {scale_dtype} {scale_layout}-major, {layout}, "
                 f"hidden {hidden}")
        a2a = moecomm.AllToAll(comm, M, E, K, hidden, None, in_dtype, "bf16", scale_dtype=scale_dtype,
                               layout=layout, scale_layout=scale_layout, dispatch_wire=wire)
        c = a2a.cfg
        drawn = draw(W, 40 + checks, hidden=hidden)
        span = np.exp(np.linspace(-6, 6, hidden, dtype=np.float32))  # values across many binades
        tokens = []
        for x, _, _ in drawn:
            v = x.astype(np.float32) * span
            v[:, :128] = 0  # a block of zeros: scale 1
            v[:, 128:256] *= 2.0 ** -20  # a block far below e4m3's normal range after scaling by 448 / absmax
            tokens.append(v.astype(c.in_dtype))
        _, ids, w = drawn[r]
        *got, _ = dispatch(a2a, tokens[r], None, ids, w)
        combine(a2a, ids, None, A.put(np.zeros(c.expert_x_shape(), c.out_dtype)))
        q = [reference.quantize_tokens(t, wire, c.scale_dtype) for t in tokens]
        ref = reference.dispatch([a for a, _ in q], [b for _, b in q], [d[1] for d in drawn], E, W, M)[r]
        against_reference(fails, label, got, ref, scale_layout, W)
        a2a.destroy()
        checks += 1
    return checks


def main():
    global A
    p = argparse.ArgumentParser()
    p.add_argument("--transport", default="host")
    transport = p.parse_args().transport
    A = Host if transport == "host" else Device
    comm = moecomm.init(transport=transport, timeout=3.0 if transport == "host" else 30.0)
    fails = []
    checks = (check_scales(comm, fails) + check_opaque(comm, fails) + check_fp8_combine(comm, fails)
              + check_quantising_dispatch(comm, fails))
    finish(comm, fails, checks)


if __name__ == "__main__":
    main()
