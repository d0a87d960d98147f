"""Plain numpy dispatch and combine for all ranks at once: the definition every transport is tested against.

Conventions (the same as :class:`moecomm.AllToAll`):

* ``world_size`` ranks form ``world_size // dp_size`` data-parallel groups of ``dp_size`` consecutive
  ranks; the ranks of a group hold the same tokens. Inputs here are given once per *group*.
* Experts are placed contiguously: rank ``r`` owns experts ``r*L ... (r+1)*L - 1`` with
  ``L = num_experts // world_size``.
* A token is delivered once to every expert in its top-k row; expert ids in a row are distinct and in
  ``[0, num_experts)``, or -1 for a slot that goes nowhere (it is not sent and adds nothing in combine);
  :func:`routing_error` says what is wrong otherwise.
* Slot order inside an expert is unspecified for real transports; the reference fills slots ordered by
  (group, token index), and :func:`canonical_rows` sorts any transport's slots the same way for comparison.
"""
import numpy as np

from ._constants import COMBINE_BLOCK, E4M3_MAX, GAP_EDGES, m_in_range  # noqa: F401 (the bound_m rule, here too)
from ._dtypes import float8_e4m3fn, float8_e8m0fnu


def relative_error(got, want):
    """L2 norm of got - want over that of want, in float32 (NaN compares as a failure: check ``not err < tol``)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def tag_error(tags, num_tags, first=0, step=1):
    """A message naming the first tag of ``tags`` (of tokens first, first + step, ...) outside [0, num_tags), or
    None if all are in range."""
    bad = np.flatnonzero((np.asarray(tags) < 0) | (np.asarray(tags) >= num_tags))
    if not bad.size:
        return None
    return (f"tags: token {first + step * int(bad[0])}: tag {int(np.asarray(tags)[bad[0]])} is outside "
            f"[0, {num_tags})")


def score_gap_bins(indices, weights):
    """Each token's router-confidence bin (moecomm._constants.GAP_EDGES, compared in float32): the gap between
    the largest and the smallest of its float32 ``weights`` [n, k] over its pairs with an expert id
    (``indices`` [n, k] >= 0), for the tokens with two or more such pairs; an int64 array of those tokens'
    bins. The kernels bin alike."""
    ids, w = np.asarray(indices), np.asarray(weights, np.float32)
    valid = ids >= 0
    counted = valid.sum(axis=1) >= 2
    top = np.where(valid, w, np.float32(-np.inf)).max(axis=1)
    low = np.where(valid, w, np.float32(np.inf)).min(axis=1)
    gap = (top - low)[counted].astype(np.float32)
    return np.searchsorted(np.array(GAP_EDGES[1:], np.float32), gap, side="right").astype(np.int64)


def routing_error(indices, num_experts):
    """Return a message describing the first invalid row of ``indices`` [m, k], or None if all are valid."""
    indices = np.asarray(indices)
    if indices.size == 0:
        return None
    bad = (indices < -1) | (indices >= num_experts)
    if bad.any():
        t, j = map(int, np.argwhere(bad)[0])
        return (f"token {t}: expert id {int(indices[t, j])} at position {j} is outside "
                f"[0, {num_experts}) (-1: no expert)")
    s = np.sort(indices.astype(np.int64), axis=1)
    dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
    if dup.any():
        t, j = map(int, np.argwhere(dup)[0])
        return f"token {t}: expert id {int(s[t, j])} appears more than once in its top-k row"
    return None


def dropped(indices, num_experts, world_size, capacity, per_rank=False):
    """The (token, expert) pairs past ``capacity`` slots per expert (or rows per rank with ``per_rank``,
    the packed layout): list over groups of [m_g, k] bool.

    Slots go to pairs in (group, token index, top-k position) order, the order moecomm's host transport
    uses; a GPU may pick other pairs (arrival order) but drops as many. Dispatch and combine with the
    dropped pairs' ids set to -1 give what a call with that capacity and ``overflow="drop"`` returns.
    """
    local = num_experts // world_size
    used = np.zeros(world_size if per_rank else num_experts, np.int64)
    out = []
    for idx in indices:
        idx = np.asarray(idx).astype(np.int64)
        d = np.zeros(idx.shape, bool)
        for t, row in enumerate(idx):
            for j, e in enumerate(row):
                if e >= 0:
                    key = e // local if per_rank else e
                    d[t, j] = used[key] >= capacity
                    used[key] += 1
        out.append(d)
    return out


def packed(rank_out):
    """One rank's :func:`dispatch` result in the packed layout: (rows [sum of counts, hidden], offsets
    [L + 1] int32, scale rows or None): each expert's slots 0..count-1, expert by expert."""
    counts = rank_out["expert_num_tokens"]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    rows = np.concatenate([rank_out["expert_x"][e, :c] for e, c in enumerate(counts)])
    scales = (None if rank_out["expert_x_scale"] is None else
              np.concatenate([rank_out["expert_x_scale"][e, :c] for e, c in enumerate(counts)]))
    return rows, offsets, scales


def dispatch(x, x_scale, indices, num_experts, world_size, max_num_tokens, dp_size=1):
    """Dispatch every group's tokens to the experts' ranks.

    Args:
        x: list over groups of [m_g, hidden] arrays (any dtype; copied bit-exactly).
        x_scale: list over groups of [m_g, hidden_scale] arrays, or None.
        indices: list over groups of [m_g, k] integer expert ids (-1: none).
        num_experts, world_size, max_num_tokens, dp_size: as in :class:`moecomm.AllToAll`.

    Returns:
        list over ranks of dicts with
        ``expert_num_tokens`` [L] int32,
        ``expert_x`` [L, max_num_tokens * groups, hidden] (slots past the count are zero),
        ``expert_x_scale`` likewise or None,
        ``origin`` [L, capacity, 2] int32: (group, token index) of each slot, -1 where empty.
    """
    groups = world_size // dp_size
    local = num_experts // world_size
    cap = max_num_tokens * groups
    hidden = x[0].shape[1]
    out = []
    for r in range(world_size):
        counts = np.zeros(local, np.int32)
        ex = np.zeros((local, cap, hidden), x[0].dtype)
        es = None if x_scale is None else np.zeros((local, cap, x_scale[0].shape[1]), x_scale[0].dtype)
        origin = np.full((local, cap, 2), -1, np.int32)
        for g in range(groups):
            for t, row in enumerate(np.asarray(indices[g]).astype(np.int64)):
                for e in row:
                    if e < 0 or e // local != r:
                        continue
                    le, slot = int(e) - r * local, counts[int(e) - r * local]
                    ex[le, slot] = x[g][t]
                    if es is not None:
                        es[le, slot] = x_scale[g][t]
                    origin[le, slot] = (g, t)
                    counts[le] += 1
        out.append(dict(expert_num_tokens=counts, expert_x=ex, expert_x_scale=es, origin=origin))
    return out


def dispatch_by_rank(x, x_scale, indices, weights, num_experts, world_size):
    """Dispatch in the ranks layout (``AllToAll(layout="ranks")``): each token once to every rank owning any of
    its experts, rows grouped by source rank in rank order, each source's in token order.

    Args:
        x, x_scale, indices: as :func:`dispatch` (a list over ranks; dp_size 1).
        weights: list over ranks of [m_r, k] float32 router weights, or None.

    Returns:
        list over ranks of dicts with ``rows`` [n, hidden] (x's dtype), ``scales`` [n, hidden_scale] or None,
        ``offsets`` [world_size + 1] int32 (source s's rows offsets[s]..offsets[s + 1] - 1),
        ``expert_num_tokens`` [L] int32 (pairs per local expert), ``indices`` [n, k] int32 (each row's
        local expert ids, -1 where another rank's or none), ``weights`` [n, k] float32 (0 there, and where
        none were given) and ``origin`` [n, 2] int32 (source rank, token) of each row.
    """
    local = num_experts // world_size
    out = []
    for r in range(world_size):
        take, offsets = [], [0]
        for g in range(world_size):
            ids = np.asarray(indices[g]).astype(np.int64)
            mine = (ids >= 0) & (ids // local == r)
            tokens = np.flatnonzero(mine.any(axis=1))
            take.append((g, tokens, np.where(mine[tokens], ids[tokens] - r * local, -1)))
            offsets.append(offsets[-1] + tokens.size)
        ids = np.concatenate([local_ids for _, _, local_ids in take]).astype(np.int32)
        w = np.concatenate([np.zeros(local_ids.shape, np.float32) if weights is None else weights[g][tokens]
                            for g, tokens, local_ids in take])
        out.append(dict(
            rows=np.concatenate([x[g][tokens] for g, tokens, _ in take]),
            scales=None if x_scale is None else np.concatenate([x_scale[g][tokens] for g, tokens, _ in take]),
            offsets=np.asarray(offsets, np.int32),
            expert_num_tokens=np.bincount(ids[ids >= 0], minlength=local).astype(np.int32),
            indices=ids, weights=np.where(ids >= 0, w, 0).astype(np.float32),
            origin=np.concatenate([np.stack([np.full(tokens.size, g), tokens], 1) for g, tokens, _ in take])
            .astype(np.int32)))
    return out


def combine_by_rank(rows, origin, m, out_dtype=None):
    """Combine in the ranks layout: each token's rows summed over the ranks that received it, in float32.

    Args:
        rows: list over ranks of [n_r, width] arrays, a row per received token (expert_y, or float32 side rows).
        origin: list over ranks of [n_r, 2] (source rank, token), as :func:`dispatch_by_rank` gives it.
        m: list over ranks of their token counts.
        out_dtype: the result's dtype (default float32).

    Returns:
        list over ranks of [m_r, width] arrays (zeros for a token no rank received).
    """
    width = rows[0].shape[1]
    out = [np.zeros((n, width), np.float32) for n in m]
    for y, o in zip(rows, origin):
        for (g, t), row in zip(o, y):
            out[g][t] += row.astype(np.float32)
    return [o.astype(out_dtype or np.float32) for o in out]


def quantize_e4m3(rows, ue8m0=False):
    """The FP8 wires' rounding (combine_wire, and dispatch_wire: :func:`quantize_tokens`): ``rows`` [n, hidden]
    float32 (hidden a multiple of COMBINE_BLOCK) as (e4m3 [n, hidden], scales [n, hidden / COMBINE_BLOCK]): each
    block of COMBINE_BLOCK values times the float32 reciprocal of its scale, absmax / E4M3_MAX (1 for a block of
    zeros), rounded to nearest e4m3. With ``ue8m0`` the scale is rounded up to a power of two and given as
    float8_e8m0fnu; else float32. Every value comes back within 2^-4 of itself (e4m3's 3 mantissa bits), or
    within scale * 2^-10 where it falls below e4m3's normal range."""
    n, hidden = rows.shape
    blocks = np.asarray(rows, np.float32).reshape(n, hidden // COMBINE_BLOCK, COMBINE_BLOCK)
    amax = np.abs(blocks).max(axis=2)
    scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1)).astype(np.float32)
    if ue8m0:  # up to a power of two, exactly: scale = m * 2^e with m in [0.5, 1)
        m, e = np.frexp(scale)
        scale = np.ldexp(np.float32(1), np.where(m == 0.5, e - 1, e)).astype(np.float32)
    inverse = (np.float32(1) / scale).astype(np.float32)  # values times the scale's reciprocal, as the kernels do
    q = np.clip(blocks * inverse[..., None], -E4M3_MAX, E4M3_MAX).astype(float8_e4m3fn).reshape(n, hidden)
    return q, scale.astype(float8_e8m0fnu) if ue8m0 else scale


def quantize_tokens(x, wire, scale_dtype):
    """A quantising dispatch's tokens as they travel (AllToAll dispatch_wire): ``x`` [n, hidden] bfloat16 or
    float16 as (float8_e4m3fn [n, hidden], scales [n, hidden_dim_scale] scale_dtype), by :func:`quantize_e4m3`
    (``wire`` "e4m3_ue8m0": power-of-two scales) and its scales as ``scale_dtype`` holds them: float32,
    float8_e8m0fnu, or int32 of four UE8M0 bytes (the first scale in the lowest byte)."""
    q, scale = quantize_e4m3(np.asarray(x).astype(np.float32), ue8m0=wire == "e4m3_ue8m0")
    scale_dtype = np.dtype(scale_dtype)
    if scale_dtype == np.float32:
        return q, scale.astype(np.float32)
    e8m0 = np.ascontiguousarray(scale.astype(float8_e8m0fnu))
    return q, e8m0 if scale_dtype == float8_e8m0fnu else e8m0.view(np.uint8).view("<i4").astype(np.int32)


def dequantize_e4m3(q, scales):
    """The inverse of :func:`quantize_e4m3`: float32 [n, hidden]."""
    n, hidden = q.shape
    blocks = q.astype(np.float32).reshape(n, hidden // COMBINE_BLOCK, COMBINE_BLOCK)
    return (blocks * scales.astype(np.float32)[..., None]).reshape(n, hidden)


def _wire(rows, wire):
    """``rows`` [n, hidden] float32 as the token side receives them over combine ``wire``."""
    return rows if wire is None else dequantize_e4m3(*quantize_e4m3(rows, wire == "e4m3_ue8m0"))


def combine(indices, weights, expert_y, origin, num_experts, world_size, out_dtype, wire=None, partials=False):
    """Combine expert outputs back to their tokens.

    Args:
        indices: list over groups of [m_g, k] expert ids (as given to dispatch).
        weights: list over groups of [m_g, k] float32 router weights.
        expert_y: list over ranks of [L, capacity, hidden] expert outputs laid out like ``origin``.
        origin: list over ranks of the ``origin`` arrays returned by :func:`dispatch`.
        out_dtype: dtype of the result.
        wire: the AllToAll's ``combine_wire``: None, or "e4m3" / "e4m3_ue8m0": the rows the expert side sends
            go through :func:`quantize_e4m3` and back.
        partials: with a wire, the weights came with dispatch: the expert side sends one float32 partial
            sum per (token, expert rank), quantised; else one expert row per (token, k), quantised from
            out_dtype.

    Returns:
        list over groups of [m_g, hidden] arrays: sum_k weights[t, k] * y(expert k of token t),
        accumulated in float32 and cast to ``out_dtype``.
    """
    local = num_experts // world_size
    where = {}
    for r in range(world_size):
        for le, slot in zip(*np.nonzero(origin[r][:, :, 0] >= 0)):
            g, t = origin[r][le, slot]
            where[(int(g), int(t), r * local + int(le))] = (r, le, slot)
    out = []
    for g, (idx, w) in enumerate(zip(indices, weights)):
        hidden = expert_y[0].shape[2]
        acc = np.zeros((len(idx), hidden), np.float32)
        for t, row in enumerate(np.asarray(idx).astype(np.int64)):
            part = {}  # expert rank: the partial sum it sends (a wire with partials)
            for j, e in enumerate(row):
                if e < 0:
                    continue
                r, le, slot = where[(g, t, int(e))]
                y = expert_y[r][le, slot].astype(np.float32)
                if wire is not None and partials:
                    part[r] = part.get(r, np.zeros(hidden, np.float32)) + np.float32(w[t, j]) * y
                else:
                    acc[t] += np.float32(w[t, j]) * _wire(y[None], wire)[0]
            for r in sorted(part):
                acc[t] += _wire(part[r][None], wire)[0]
        out.append(acc.astype(out_dtype))
    return out


def canonical_rows(count, *arrays):
    """The first ``count`` rows of each [capacity, ...] array, joined per slot and sorted by their bytes.

    Returns a uint8 [count, bytes per slot] array: two slot layouts hold the same tokens (with the same
    scales) exactly when their canonical rows are equal, whatever the slot order.
    """
    parts = [np.ascontiguousarray(a[:count]).view(np.uint8).reshape(count, int(np.prod(a.shape[1:])) * a.itemsize)
             for a in arrays if a is not None]
    keys = np.concatenate(parts, axis=1)
    return keys[np.lexsort(keys.T[::-1])] if count else keys


def dispatch_backward(grad_expert_x, origin, rows, dtype=None):
    """The gradient of :func:`dispatch` with respect to the tokens: each token gets the sum of its slots'
    gradients, over every expert it went to (nothing for -1 ids or dropped pairs).

    Args:
        grad_expert_x: list over ranks of [L, capacity, hidden] float gradients, laid out like ``origin``.
        origin: list over ranks of the ``origin`` arrays returned by :func:`dispatch` ((group, token) of
            each slot).
        rows: list over groups of the token counts m_g.
        dtype: dtype of the result (default: that of grad_expert_x).

    Returns:
        list over groups of [m_g, hidden] arrays, accumulated in float32.
    """
    hidden = grad_expert_x[0].shape[-1]
    acc = [np.zeros((m, hidden), np.float32) for m in rows]
    for g_ex, org in zip(grad_expert_x, origin):
        for le, slot in zip(*np.nonzero(org[:, :, 0] >= 0)):
            g, t = org[le, slot]
            acc[g][t] += g_ex[le, slot].astype(np.float32)
    return [a.astype(dtype or grad_expert_x[0].dtype) for a in acc]


def combine_backward(indices, weights, grad_out, expert_y, origin, num_experts, world_size):
    """The gradient of :func:`combine` with respect to the expert outputs and the router weights.

    Args:
        indices, weights: as given to :func:`combine` (lists over groups of [m_g, k]).
        grad_out: list over groups of [m_g, hidden] float gradients of the combined tokens.
        expert_y: list over ranks of the [L, capacity, hidden] expert outputs combine read.
        origin: list over ranks of the ``origin`` arrays returned by :func:`dispatch`.

    Returns:
        ``(grad_expert_y, grad_weights)``: list over ranks of [L, capacity, hidden] arrays of grad_out's dtype,
        ``weights[t, k] * grad_out[t]`` in the slot of pair (t, k) and zeros in empty slots; list over groups of
        [m_g, k] float32, ``<grad_out[t], expert_y(slot of (t, k))>`` accumulated in float32 (0 for -1 ids
        and pairs without a slot).
    """
    local = num_experts // world_size
    grad_ey = [np.zeros(y.shape, grad_out[0].dtype) for y in expert_y]
    grad_w = [np.zeros(np.asarray(i).shape, np.float32) for i in indices]
    for r, org in enumerate(origin):
        for le, slot in zip(*np.nonzero(org[:, :, 0] >= 0)):
            g, t = (int(v) for v in org[le, slot])
            k = int(np.nonzero(np.asarray(indices[g][t]).astype(np.int64) == r * local + le)[0][0])
            go = grad_out[g][t].astype(np.float32)
            grad_ey[r][le, slot] = (np.float32(weights[g][t, k]) * go).astype(grad_out[0].dtype)
            grad_w[g][t, k] = np.dot(go, expert_y[r][le, slot].astype(np.float32))
    return grad_ey, grad_w


if __name__ == "__main__":
    raise SystemExit("moecomm.reference is a library module, not a command: numpy references of dispatch "
                     "and combine (docs/api.md).")
