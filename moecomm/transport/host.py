"""The host transport: dispatch and combine across CPU ranks with numpy arrays and mpi4py.

Real communication, the same semantics and wire plan as the GPU kernels (dispatch records in their layout,
moecomm._abi.RecordLayout): each token goes once to every *rank* that owns one of its experts and is fanned
out to the local experts there; combine sends back one
float32 partial sum per (token, expert rank) when the router weights came with dispatch, else one row per
(token, expert). Every MPI operation is non-blocking and waited on with a deadline, so a dead peer raises
:class:`moecomm.CommTimeout` naming it instead of hanging.

Every send half starts with a header to every rank: the AllToAll's number, the phase, the call's number,
a status and a reason. So a rank whose input is bad (expert ids, ``m``, an argument AllToAll refused)
still takes part, every rank raises within one exchange (the faulty rank its own error, the others
:class:`moecomm.PeerError` or :class:`moecomm.InvalidRouting` naming it) and the next call works; and
two ranks in different AllToAlls, phases or calls raise :class:`moecomm.OutOfStep` instead of
exchanging data. Masked ranks (``AllToAll.mask_ranks``) get no header and no data and are not waited for.
"""
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from .. import _constants as C
from .. import reference
from .._abi import RecordLayout
from .._arrays import HostArrays
from .._dtypes import float8_e4m3fn, float8_e8m0fnu
from .._constants import BYTE_FIELDS, COUNTER_FIELDS
from .._errors import (IDS_DIFFER, CapacityExceeded, ExpertMapMismatch, InvalidArgument, InvalidRouting,
                       MoeCommError, OutOfStep, PeerError, weights_differ)
from .._mpi import TAG_PEER_CHECK, exchange_tag, wait_all
from .base import AllToAllBackend, Transport, first_send, host_call_records, peer_pattern, snapshot

# a header's status: the device error codes, as the kernels flag a failed call (moecomm._constants)
_OK, _BAD_ROUTING, _BAD_M, _BAD_ARG = C.ERR_NONE, C.ERR_BAD_EXPERT, C.ERR_BAD_M, C.ERR_REFUSED
# the exchanges of an AllToAll (moecomm._mpi.PHASES of them): demand is the pairs per expert, exchanged first when a
# capacity is set; the backward ones are the gradients' (dispatch_backward, combine_backward and its weights)
_PHASES = ("dispatch", "combine", "demand", "dispatch_backward", "combine_backward", "weights_backward")
_C = {name: i for i, name in enumerate(COUNTER_FIELDS)}
_FIELDS, _HEADER = 8, 256  # header: int64 [alltoall, phase, call, status, count, map generation, agree, call_id],
                           # then the reason (UTF-8); agree: what every rank must pass alike (_Exchange.post)


class _Exchange:
    """The exchanges of one phase of one AllToAll: byte records with every rank, point to point (so a
    silent peer can be named), each preceded by a header to every rank.

    ``post`` sends ``rows`` (uint8 [n, record_bytes], grouped by destination rank in rank order) after the
    headers; ``finish`` waits and returns the received rows grouped by source rank and the counts.
    """

    def __init__(self, comm, departures, timeout_s, alltoall, phase):
        self.comm, self.departures, self.timeout_s = comm, departures, timeout_s
        self.alltoall, self.phase = alltoall, phase
        self.map_generation = 0  # of the expert map in use (AllToAll.set_expert_map), carried by every header
        self.tag = exchange_tag(_PHASES.index(phase), 0)
        self.calls = 0
        self.live = list(range(comm.Get_size()))  # the ranks not masked
        self._receives = []  # receives of the exchange in progress (cancelled by restart())

    def restart(self, live, generation):
        """Start over with the ranks ``live`` in ``generation``: receives left open by a failed exchange are
        cancelled (a stale receive would swallow a later message), messages sent to a rank that was not
        listening stay behind under the old generation's tags, and calls are counted from zero again."""
        for r in self._receives:
            if not r.Test():
                r.Cancel()
                r.Wait()
        self._receives, self.calls, self.live = [], 0, list(live)
        self.tag = exchange_tag(_PHASES.index(self.phase), generation)

    def post(self, rows, dest_counts, status, reason="", agree=0, call_id=-1):
        """Exchange headers; then, if every rank's status is OK, post the rows. Returns (pending or None,
        statuses [world], reasons [world]). ``status``: OK, or the error code of this rank's failed part (a
        refusal's reason: moecomm._constants). ``agree``: what every rank must pass alike in this exchange (a
        backward call's plan stamp, :func:`_stamp`; combine: whether it was given router weights);
        InvalidArgument on every rank otherwise (:func:`_disagreement`), nothing exchanged. ``call_id``: the
        program's number of the call (-1: none given), which every rank's must equal: OutOfStep otherwise."""
        w, c, live = self.comm.Get_size(), self.comm, self.live
        self.calls += 1
        me = (self.alltoall, _PHASES.index(self.phase), self.calls)
        deadline = time.monotonic() + self.timeout_s
        head = np.zeros((w, _HEADER), np.uint8)
        fields = head[:, :8 * _FIELDS].view(np.int64)
        fields[:, :3], fields[:, 3], fields[:, 4], fields[:, 5] = me, status, dest_counts, self.map_generation
        fields[:, 6], fields[:, 7] = agree, call_id
        text = reason.encode()[:_HEADER - 8 * _FIELDS]
        head[:, 8 * _FIELDS:8 * _FIELDS + len(text)] = np.frombuffer(text, np.uint8)
        heads = np.zeros((w, _HEADER), np.uint8)
        heads[:, :8 * _FIELDS].view(np.int64)[:, :3] = me  # masked ranks: in step, OK, no rows, same map
        heads[:, :8 * _FIELDS].view(np.int64)[:, 5:8] = self.map_generation, agree, call_id
        recvs = self._receives = [c.Irecv(heads[s], source=s, tag=self.tag) for s in live]
        sends = [c.Isend(head[d], dest=d, tag=self.tag) for d in live]
        wait_all(recvs + sends, live * 2, deadline, self.timeout_s, self.phase, self.departures)
        got = heads[:, :8 * _FIELDS].view(np.int64)
        for s in live:
            if tuple(got[s, :3]) != me:
                a, phase, call = (int(v) for v in got[s, :3])
                theirs = _PHASES[phase] if 0 <= phase < len(_PHASES) else f"phase {phase}"
                raise OutOfStep(f"{self.phase}: rank {s} is in AllToAll #{a} {theirs} call {call} while this "
                                f"rank is in AllToAll #{self.alltoall} {self.phase} call {self.calls}")
        other = [s for s in live if got[s, 7] != call_id]
        if other:
            raise OutOfStep(f"{self.phase}: rank {other[0]}'s call is the program's call {int(got[other[0], 7])} "
                            f"(call_id), this rank's call {call_id} (-1: none given): a rank skipped or repeated a "
                            f"call; nothing was exchanged")
        other = [s for s in live if got[s, 5] != self.map_generation]
        if other:
            raise ExpertMapMismatch(f"{self.phase}: rank {other[0]} routes with expert map generation "
                                    f"{int(got[other[0], 5])}, this rank with {self.map_generation}: nothing was "
                                    f"exchanged (set_expert_map is collective)")
        statuses = got[:, 3].copy()
        reasons = [bytes(heads[s, 8 * _FIELDS:]).rstrip(b"\0").decode(errors="replace") for s in range(w)]
        if statuses.any():  # a refusal is named before the rest is compared (a refused rank's may be unreadable)
            return None, statuses, reasons
        other = [s for s in live if got[s, 6] != agree]
        if other:
            raise InvalidArgument(_disagreement(self.phase, other[0], int(got[other[0], 6]), agree))
        src_counts = got[:, 4].copy()
        recv = np.empty((int(src_counts.sum()), rows.shape[1]), np.uint8)
        reqs, peers = [], []
        src_off = np.concatenate([[0], np.cumsum(src_counts)])
        dst_off = np.concatenate([[0], np.cumsum(dest_counts)])
        for s in range(w):
            if src_counts[s]:
                reqs.append(c.Irecv(recv[src_off[s]:src_off[s + 1]], source=s, tag=self.tag + 1))
                peers.append(s)
        self._receives = list(reqs)
        for d in range(w):
            if dest_counts[d]:
                reqs.append(c.Isend(rows[dst_off[d]:dst_off[d + 1]], dest=d, tag=self.tag + 1))
                peers.append(d)
        return (reqs, peers, rows, recv, src_counts, deadline), statuses, reasons

    def finish(self, pending):
        reqs, peers, _rows, recv, src_counts, deadline = pending
        wait_all(reqs, peers, deadline, self.timeout_s, self.phase, self.departures)
        return recv, src_counts

    def refuse(self, refusal):
        """Take part in an exchange as a rank whose part of the call failed (``refusal``: a
        moecomm.alltoall.Refusal, refused or ended): header only, flagged with its code, no data (the call
        ends there on every rank)."""
        self.post(np.zeros((0, 0), np.uint8), np.zeros(self.comm.Get_size(), np.int64), refusal.code, refusal.text)


def _disagreement(phase, q, theirs, mine):
    """The message of an exchange whose ``agree`` words differ: rank q's ``theirs``, this rank's ``mine``."""
    if phase == "combine":
        return f"{weights_differ(q, theirs, mine)}; nothing was exchanged"
    return (f"{phase}: rank {q} follows the routing plan of dispatch call {theirs & 0xFFFFFFFF} (generation "
            f"{theirs >> 32}), this rank that of call {mine & 0xFFFFFFFF} (generation {mine >> 32}): every rank "
            f"passes the plan of the same forward call; nothing was exchanged")


def _raise_status(statuses, reasons, own, phase):
    """The error of an exchange in which some rank's status was not OK: ``own`` is this rank's (status,
    message) when its input was bad."""
    if own is not None:
        status, message = own
        raise (InvalidArgument if status & 0xFF == _BAD_ARG else InvalidRouting)(f"{phase}: {message}")
    bad = [int(r) for r in np.nonzero(statuses)[0]]
    ended = [r for r in bad if statuses[r] & 0xFF in (_BAD_ARG, C.ERR_ENDED)]
    if ended:
        r = ended[0]
        what = "ended the call" if statuses[r] == C.ERR_ENDED else "refused its call"
        raise PeerError(f"{phase}: rank {r} {what} ({reasons[r]}); nothing was exchanged", peer=r,
                        reason=reasons[r])
    kinds = {_BAD_ROUTING: "invalid expert ids", _BAD_M: "bound_m out of range"}
    detail = ", ".join(f"rank {r}: {kinds.get(int(statuses[r]), 'error')}" for r in bad)
    raise InvalidRouting(f"{phase}: peers reported bad input ({detail}); nothing was exchanged")


def _bad_m(m, rows):
    """The message of a bound_m out of range (``rows``: at most max_num_tokens and the fewest rows of the
    call's per-token arrays)."""
    return (f"bound_m={m} must be in [0, {rows}]: at most max_num_tokens and the rows of each per-token array of "
            f"the call")


def _stamp(call):
    """A routing plan's ``call`` ([2] int32: the AllToAll's restart generation, the dispatch's call number) as
    the int64 backward headers carry (never 0: dispatch calls count from 1)."""
    return int(call[0]) << 32 | int(call[1])


def _records(*parts):
    """Join per-row arrays into one uint8 [n, bytes] record array."""
    n = parts[0].shape[0]
    return np.concatenate([np.ascontiguousarray(p).view(np.uint8).reshape(n, p.itemsize * int(np.prod(p.shape[1:])))
                           for p in parts], axis=1)


@dataclass
class _Received:
    """What dispatch received, kept for combine (and, from a routing plan, what the backward sends back to)."""
    src_rank: np.ndarray    # [n] source rank of each received token
    token: np.ndarray       # [n] token index on the source group
    pair_j: np.ndarray      # [p] received token of each (token, local expert) pair
    pair_k: np.ndarray      # [p] top-k position of the pair
    where: tuple            # index of each (token, local expert) pair in out_expert_x / expert_y:
                            # (local expert [p], slot [p]) padded, (row [p],) packed and ranks
    weights: object         # [n, k] float32 router weights sent with dispatch, or None
    local: object = None    # [n, k] int32 each received token's local expert ids (-1: another rank's)

    def origin(self):
        """[p, 3] int32 (source rank, token, top-k position) of each pair, the rows of a plan's origin."""
        return np.stack([self.src_rank[self.pair_j], self.token[self.pair_j], self.pair_k], axis=1).astype(np.int32)

    @classmethod
    def from_origin(cls, origin, max_num_tokens):
        """What a dispatch with this ``origin`` (a routing plan's: [..., 3] int32, -1 where empty) received."""
        where = np.nonzero(origin[..., 0] >= 0)
        src, token, k = (origin[where][:, i].astype(np.int64) for i in range(3))
        received, pair_j = np.unique(src * max_num_tokens + token, return_inverse=True)
        return cls(received // max_num_tokens, (received % max_num_tokens).astype(np.int32), pair_j, k, where, None)


class HostAllToAll(AllToAllBackend):
    gradients = True

    def __init__(self, comm, departures, cfg, timeout_s, ident):
        self.comm, self.cfg, self.timeout_s = comm, cfg, timeout_s
        self._exchanges = {phase: _Exchange(comm, departures, timeout_s, ident, phase) for phase in _PHASES}
        self._dispatch_pending = None
        self._combine_pending = None
        self._received = None
        self._dispatched_m = self._dispatched_ids = None  # the last dispatch's m and ids (combine checks its own)
        self._sent = None  # (this rank's tokens [n], their physical expert ids [n, k]: -1 not sent) of the dispatch
                           # (pairs dropped for capacity keep theirs, as on GPUs)
        self._generation = 0  # restarts of the call sequence (set_mask)
        self._dispatch_call = None  # (generation, call number) of the last dispatch: its plan's stamp
        self._masked = np.zeros(cfg.world_size, bool)
        self.expert_map = None
        self._dropped = None  # [n, k] this rank's pairs of the last dispatch dropped for capacity
        L, W, window = cfg.num_local_experts, cfg.world_size, cfg.telemetry_window
        self._layout = RecordLayout.of(cfg)  # dispatch records: the kernels' layout
        self._counters = np.zeros(len(COUNTER_FIELDS), np.int64)
        self._per_expert = np.zeros((2, L), np.int64)  # tokens received, pairs dropped
        self._bytes = np.zeros((len(BYTE_FIELDS), W), np.int64)
        self._ring = np.zeros((window, L), np.int64)
        self._tag_ring = np.zeros((window, cfg.num_tags, L), np.int64)  # [call, tag, local expert] kept pairs
        self._gap_ring = np.zeros((window, C.GAP_BINS), np.int64)  # [call, bin] tokens per confidence bin
        self._gap = None  # [GAP_BINS] the dispatch in flight's tokens per bin (score_gap, weights given)
        self._demand = None  # [L] pairs routed to this rank's experts in the call (with a capacity)
        self._times = {"dispatch": deque(maxlen=window), "combine": deque(maxlen=window)} if cfg.timing else None
        self._started = {}
        self._records = host_call_records()  # filled by AllToAll before each call (records())

    def records(self):
        return self._records

    # dispatch -------------------------------------------------------------------------------
    def dispatch(self, record, do_send, do_recv, stream, sources=None):
        if do_send:
            self._started["dispatch"] = time.perf_counter()
            self._received = None  # until this dispatch's receive half
            self._dispatch_pending = self._dispatch_send(record)
        if do_recv:
            pending, self._dispatch_pending = self._dispatch_pending, None
            self._dispatch_recv(record, pending)
            self._timed("dispatch")
            if sources is not None:
                self.write_sources(*sources, stream)

    def _timed(self, phase):
        """timing=True: the phase's host time, send start to receive end."""
        if self._times is not None and phase in self._started:
            self._times[phase].append(1e6 * (time.perf_counter() - self._started.pop(phase)))

    def _tally(self, kind, per_peer):
        """Add [W] bytes per peer to BYTE_FIELDS counter ``kind`` (this rank's own entry stays 0; telemetry
        off: nothing)."""
        if not len(self._ring):
            return
        b = np.asarray(per_peer, np.int64).copy()
        b[self.cfg.rank] = 0
        self._bytes[BYTE_FIELDS.index(kind)] += b

    def _dispatch_send(self, a):
        cfg = self.cfg
        L = cfg.num_local_experts
        m = int(a.bound_m[0])
        status, message = _OK, None
        self._demand = None
        self._call_id = -1 if a.call_id is None else int(a.call_id[0])  # every rank's must equal (_Exchange.post)
        if not reference.m_in_range(m, a.rows, cfg.max_num_tokens):
            status, message = _BAD_M, _bad_m(m, min(a.rows, cfg.max_num_tokens))
        else:
            message = reference.routing_error(a.indices[:m], cfg.num_experts)
            status = _BAD_ROUTING if message else _OK
        if status == _OK and a.tags is not None:
            message = reference.tag_error(a.tags[cfg.dp_rank:m:cfg.dp_size], cfg.num_tags, cfg.dp_rank, cfg.dp_size)
            status = C.REASON_BAD_TAG if message else _OK
        mine = np.arange(cfg.dp_rank, m if status == _OK else 0, cfg.dp_size)
        self._gap = None if not cfg.score_gap or a.weights is None else np.bincount(
            reference.score_gap_bins(a.indices[mine], a.weights[mine]), minlength=C.GAP_BINS)
        idx = a.indices[mine].astype(np.int64)
        if self.expert_map is not None:  # logical ids -> physical slots, by the map's replica rule
            idx = self.expert_map.physical(idx, mine, cfg.dp_group, np.flatnonzero(self._masked))
        owner = np.where(idx >= 0, idx // L, -1)  # id -1: no expert, no destination
        masked = (owner >= 0) & self._masked[np.maximum(owner, 0)]
        self._counters[_C["MASKED_PAIRS"]] += int(masked.sum())
        owner[masked] = -1
        idx[masked] = -1
        self._dropped = np.zeros(idx.shape, bool)
        routed = np.where(owner >= 0, idx, -1).astype(np.int32)  # the plan's: dropped pairs too (no slot there)
        if cfg.capacity is not None:
            self._dropped = self._capacity(idx, status, message)
            owner[self._dropped] = -1
        sent = np.where(owner >= 0, idx, -1).astype(np.int32)  # dropped and masked pairs: none
        per_rank, counts = self._per_rank(sent)
        x, x_scale = a.x, a.x_scale
        if cfg.dispatch_wire is not None:  # quantised once, as the kernels do where they read the row
            x, x_scale = reference.quantize_tokens(a.x[:mine[-1] + 1 if len(mine) else 0], cfg.dispatch_wire,
                                                   cfg.scale_dtype)
        rows = np.concatenate([self._dispatch_records(x[t], None if x_scale is None else x_scale[t], t, local,
                                                      None if a.weights is None else a.weights[t],
                                                      None if a.tags is None else a.tags[t])
                               for t, local in ((mine[sel], local) for sel, local in per_rank)])
        ex = self._exchanges["dispatch"]
        pending, statuses, reasons = ex.post(rows, counts, status, message or "", call_id=self._call_id)
        if pending is None:
            _raise_status(statuses, reasons, (status, message) if status else None, "dispatch")
        self._tally("dispatch_sent", counts * rows.shape[1])
        self._dispatched_m, self._dispatched_ids = m, a.indices[:m].copy()
        self._sent, self._dispatch_call = (mine, routed), (self._generation, ex.calls)
        return ex, pending, a.weights is not None

    def _per_rank(self, ids):
        """Physical expert ids [n, k] (-1: none) by destination rank: a list over ranks d of (rows [n] bool
        with a pair to d, their ids as d's local experts [rows, k] int32, -1 elsewhere), and counts [W]."""
        L, W = self.cfg.num_local_experts, self.cfg.world_size
        owner = np.where(ids >= 0, ids // L, -1)
        out, counts = [], np.zeros(W, np.int64)
        for d in range(W):
            to_d = owner == d
            sel = to_d.any(axis=1)
            counts[d] = sel.sum()
            out.append((sel, np.where(to_d[sel], ids[sel] - d * L, -1).astype(np.int32)))
        return out, counts

    def _dispatch_records(self, x, scales, tokens, local, weights, tags):
        """Dispatch records in the kernels' layout (moecomm._abi.RecordLayout): uint8 [n, record size], the token
        row, its scales, then int32 token, int32 local expert ids [k] (-1: not this rank's), float32 weights [k]
        (zeros when none were given), int32 tag (-1 when none were given)."""
        lay, n = self._layout, x.shape[0]
        rows = np.zeros((n, lay.size), np.uint8)
        rows[:, :lay.x_bytes] = np.ascontiguousarray(x).view(np.uint8).reshape(n, lay.x_bytes)
        if scales is not None:
            rows[:, lay.scale_off:lay.scale_off + lay.scale_bytes] = (
                np.ascontiguousarray(scales).view(np.uint8).reshape(n, lay.scale_bytes))
        w = np.zeros(local.shape, np.float32) if weights is None else weights.astype(np.float32)
        tag = np.full(n, -1, np.int32) if tags is None else tags.astype(np.int32)
        meta = _records(tokens.astype(np.int32)[:, None], local, w, tag[:, None])
        rows[:, lay.meta_off:lay.meta_off + meta.shape[1]] = meta
        return rows

    def _capacity(self, idx, status, message):
        """Exchange every rank's demand per expert (the call's first exchange when a capacity is set: bad
        input is reported here); raise CapacityExceeded on every rank ("error"), or return the pairs of
        ``idx`` [n, k] (physical ids, -1: none) past the capacity ("drop"). The capacity holds per expert
        (padded layout) or per rank (packed layout); slots go in (source rank, token, top-k) order, so every
        rank knows which of its own pairs get none."""
        cfg, W, L = self.cfg, self.cfg.world_size, self.cfg.num_local_experts
        E, cap, packed = W * L, cfg.capacity, cfg.layout == "packed"
        valid = idx >= 0
        mine = np.bincount(idx[valid], minlength=E).astype(np.int64)
        ex = self._exchanges["demand"]
        live = np.array([not m for m in self._masked], np.int64)
        rows = np.repeat(mine.view(np.uint8)[None], int(live.sum()), axis=0)
        pending, statuses, reasons = ex.post(rows, live, status, message or "", call_id=self._call_id)
        if pending is None:
            _raise_status(statuses, reasons, (status, message) if status else None, "dispatch")
        got, src = ex.finish(pending)
        demand = np.zeros((W, E), np.int64)
        demand[np.repeat(np.arange(W), src)] = np.ascontiguousarray(got).view(np.int64).reshape(-1, E)
        self._demand = demand.sum(axis=0)[cfg.rank * L:(cfg.rank + 1) * L]
        if packed:  # one budget per destination rank
            demand, key = demand.reshape(W, W, L).sum(axis=2), np.where(valid, idx // L, W)
        else:
            key = np.where(valid, idx, E)
        total = demand.sum(axis=0)
        if (total > cap).any() and cfg.overflow == "error":
            mine = total[cfg.rank] if packed else total[cfg.rank * L:(cfg.rank + 1) * L]
            self._counters[_C["OVERFLOW_PAIRS"]] += int(np.maximum(mine - cap, 0).sum())
            q = int(np.argmax(total > cap))
            what = f"rank {q}" if packed else f"expert {q} (rank {q // L})"
            over = total > cap
            others = f", {int(over.sum()) - 1} more {'ranks' if packed else 'experts'} over" if over.sum() > 1 else ""
            raise CapacityExceeded(f"dispatch: {what} got {int(total[q])} (token, expert) pairs, capacity {cap}"
                                   f"{others}; {int((total - cap)[over].sum())} pairs over in all; nothing was "
                                   f"exchanged", expert=-1 if packed else q, demand=int(total[q]), capacity=cap)
        before = demand[:cfg.rank].sum(axis=0)  # slots taken by lower source ranks
        flat = key.ravel()  # token order, then top-k order; the sentinel len(before) marks no pair
        order = np.argsort(flat, kind="stable")
        seen = np.empty_like(order)
        starts = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=before.size + 1))[:-1]])
        seen[order] = np.arange(flat.size) - starts[flat[order]]
        position = np.append(before, 0)[flat] + seen
        return (valid.ravel() & (position >= cap)).reshape(idx.shape)

    def _dispatch_recv(self, a, pending):
        cfg = self.cfg
        ex, p, has_weights = pending
        recv, src_counts = ex.finish(p)
        K, lay = cfg.experts_per_token, self._layout
        x = recv[:, :lay.x_bytes].view(cfg.expert_dtype)
        meta = np.ascontiguousarray(recv[:, lay.meta_off:lay.meta_off + 8 + 8 * K])
        token, local = meta[:, :4].view(np.int32)[:, 0], meta[:, 4:4 + 4 * K].view(np.int32)
        weights = meta[:, 4 + 4 * K:4 + 8 * K].view(np.float32) if has_weights else None
        tag = meta[:, 4 + 8 * K:].view(np.int32)[:, 0]
        pair_j, pair_k = np.nonzero(local >= 0)
        pair_le = local[pair_j, pair_k]
        counts = np.bincount(pair_le, minlength=cfg.num_local_experts)
        order = np.argsort(pair_le, kind="stable")
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        pair_slot = np.empty_like(pair_le)
        pair_slot[order] = np.arange(pair_le.size) - starts[pair_le[order]]
        where = (pair_le, pair_slot)
        if cfg.layout == "packed":  # expert by expert, back to back
            where = (starts[pair_le] + pair_slot,)
            a.out_offsets[:] = np.concatenate([starts, [pair_le.size]])
        elif cfg.layout == "ranks":  # a row per token as received: sources in rank order, each in token order
            where = (pair_j,)
            a.out_offsets[:] = np.concatenate([[0], np.cumsum(src_counts)])
        # the rows written (at: their index in out_expert_x) and the received token each holds (rows)
        rows = np.arange(len(recv)) if cfg.layout == "ranks" else pair_j
        at = (rows,) if cfg.layout == "ranks" else where
        a.out_x[at] = x[rows]
        if lay.scale_bytes:
            scales = np.ascontiguousarray(recv[:, lay.scale_off:lay.scale_off + lay.scale_bytes]).view(
                cfg.scale_dtype)[rows]
            if cfg.scale_layout == "row":
                a.out_scale[at] = scales
            elif cfg.layout != "padded":  # column-major: [scales, rows]
                a.out_scale[:, at[0]] = scales.T
            else:  # column-major per expert: [L, scales, slots]
                a.out_scale[where[0], :, where[1]] = scales
        a.out_num[:] = counts
        demand = counts if self._demand is None else self._demand
        self._tally("dispatch_received", src_counts * recv.shape[1])
        self._per_expert[1] += demand - counts
        self._counters[_C["DROPPED_PAIRS"]] += int((demand - counts).sum())
        if len(self._ring):  # telemetry on
            row = self._counters[_C["CALLS"]] % len(self._ring)
            self._per_expert[0] += counts
            self._ring[row] = demand
            if cfg.num_tags:  # kept pairs per (tag, local expert); a token sent without a tag counts none
                self._tag_ring[row] = 0
                tagged = tag[pair_j] >= 0
                np.add.at(self._tag_ring[row], (tag[pair_j][tagged], pair_le[tagged]), 1)
            if cfg.score_gap:
                self._gap_ring[row] = 0 if self._gap is None else self._gap
        self._counters[_C["CALLS"]] += 1
        self._demand = None
        src_rank = np.repeat(np.arange(cfg.world_size), src_counts)
        self._received = _Received(src_rank, token, pair_j, pair_k, where, weights, local)

    # combine --------------------------------------------------------------------------------
    def combine(self, record, do_send, do_recv, stream):
        if do_send:
            self._started["combine"] = time.perf_counter()
            self._combine_pending = self._combine_send(record)
        if do_recv:
            pending, self._combine_pending = self._combine_pending, None
            self._combine_recv(record, pending)
            self._timed("combine")

    def _combine_send(self, a):
        cfg, rv = self.cfg, self._received
        ex, m = self._exchanges["combine"], int(a.bound_m[0])
        bad = ((_BAD_ARG, f"bound_m={m} differs from the dispatched m={self._dispatched_m}")
               if m != self._dispatched_m else (_BAD_M, _bad_m(m, min(a.rows, cfg.max_num_tokens)))
               if not reference.m_in_range(m, a.rows, cfg.max_num_tokens) else
               (C.REASON_IDS_DIFFER, IDS_DIFFER) if not np.array_equal(a.indices[:m], self._dispatched_ids) else None)
        if bad:  # refused in the exchange, so that every rank raises
            _, statuses, reasons = ex.post(np.zeros((0, 0), np.uint8), np.zeros(cfg.world_size, np.int64), *bad,
                                           agree=int(not a.partials))
            _raise_status(statuses, reasons, bad, "combine")
        if cfg.layout == "ranks":  # a row per received token, unweighted, with its float32 side row
            n = rv.token.size
            side = () if a.expert_w is None else (a.expert_w[:n],)
            row_src, fields = rv.src_rank, [rv.token[:, None], a.y[:n].astype(np.float32), *side]
        elif a.partials:  # sum this rank's experts per token, weighted, on the expert side
            part = np.zeros((rv.token.size, cfg.hidden_dim), np.float32)
            np.add.at(part, rv.pair_j, rv.weights[rv.pair_j, rv.pair_k][:, None] * a.y[rv.where].astype(np.float32))
            row_src, fields = rv.src_rank, [rv.token[:, None], *self._to_wire(part)]
        else:  # one row per (token, expert): the token side weights and sums
            row_src = rv.src_rank[rv.pair_j]
            fields = [rv.token[rv.pair_j][:, None], rv.pair_k.astype(np.int32)[:, None],
                      *(self._to_wire(a.y[rv.where].astype(np.float32)) if cfg.combine_wire else (a.y[rv.where],))]
        rows, counts = self._to_groups(row_src, fields)
        pending, statuses, reasons = ex.post(rows, counts, _OK, agree=int(not a.partials))
        if pending is None:
            _raise_status(statuses, reasons, None, "combine")
        self._tally("combine_sent", counts * rows.shape[1])
        return ex, pending, bool(a.partials)

    def _to_wire(self, rows):
        """Combine's rows [n, H] float32 as they travel: themselves, or with a combine_wire FP8 e4m3 values
        and their block scales (moecomm.reference.quantize_e4m3)."""
        wire = self.cfg.combine_wire
        return (rows,) if wire is None else reference.quantize_e4m3(rows, wire == "e4m3_ue8m0")

    def _from_wire(self, recv, dtype):
        """Received combine rows (the bytes after the record's ints) as float32 [n, H]: values of ``dtype``
        (float32 partial sums, or out_dtype rows), or with a combine_wire dequantised e4m3."""
        H, wire, recv = self.cfg.hidden_dim, self.cfg.combine_wire, np.ascontiguousarray(recv)
        if wire is None:
            return recv.view(dtype).astype(np.float32).reshape(-1, H)
        scale = float8_e8m0fnu if wire == "e4m3_ue8m0" else np.float32
        return reference.dequantize_e4m3(recv[:, :H].view(float8_e4m3fn), np.ascontiguousarray(recv[:, H:]).view(scale))

    def _to_groups(self, row_src, fields):
        """Records of ``fields`` (per-row arrays) for every rank of the DP group of each row's source rank
        ``row_src``: (rows grouped by destination, counts [W])."""
        cfg = self.cfg
        group = row_src // cfg.dp_size
        parts, counts = [], np.zeros(cfg.world_size, np.int64)
        for d in range(cfg.world_size):  # every rank of the token's DP group gets the result
            sel = group == d // cfg.dp_size
            counts[d] = sel.sum()
            parts.append(_records(*[f[sel] for f in fields]))
        return np.concatenate(parts), counts

    def _combine_recv(self, a, pending):
        cfg = self.cfg
        ex, p, partials = pending
        recv, src_counts = ex.finish(p)
        self._tally("combine_received", src_counts * recv.shape[1])
        m = self._dispatched_m
        token = np.ascontiguousarray(recv[:, :4]).view(np.int32)[:, 0]
        acc = np.zeros((m, cfg.hidden_dim), np.float32)
        if cfg.layout == "ranks":  # float32 rows, then the side rows
            rows = np.ascontiguousarray(recv[:, 4:]).view(np.float32)
            np.add.at(acc, token, rows[:, :cfg.hidden_dim])
            if a.out_w is not None:
                side = np.zeros((m, cfg.experts_per_token), np.float32)
                np.add.at(side, token, rows[:, cfg.hidden_dim:])
                a.out_w[:m] = side
        elif partials:
            np.add.at(acc, token, self._from_wire(recv[:, 4:], np.float32))
        else:
            k = np.ascontiguousarray(recv[:, 4:8]).view(np.int32)[:, 0]
            y = self._from_wire(recv[:, 8:], cfg.out_dtype)
            np.add.at(acc, token, a.weights[token, k].astype(np.float32)[:, None] * y)
        a.out_tokens[:m] = acc.astype(cfg.out_dtype)
        if a.zero_tail:
            a.out_tokens[m:a.rows] = 0
        if a.out_dropped is not None:  # this rank's own pairs (dp_size 1 when a capacity is set)
            a.out_dropped[:] = 0
            if self._dropped is not None and cfg.dp_size == 1:
                a.out_dropped[:m] = self._dropped

    # backward: the gradients, along a routing plan ------------------------------------------
    def write_plan(self, plan, stream=None):
        expert, origin, call, held, local = plan
        if self._received is None:
            raise InvalidArgument("plan: no dispatch has been received since construction or the last mask_ranks "
                                  "(or the last one failed)")
        mine, sent = self._sent
        expert[:] = -1
        expert[mine] = sent
        origin[:] = -1
        origin[self._received.where] = self._received.origin()
        call[:] = self._dispatch_call
        slots = np.flatnonzero(origin[..., 0] >= 0)
        held[0], held[1:1 + slots.size] = slots.size, slots
        pairs = origin.reshape(-1, 3)
        own = slots[pairs[slots, 0] == self.cfg.rank]
        local[:] = -1
        local[pairs[own, 1], pairs[own, 2]] = own

    def write_row_routing(self, indices, idx64, weights, stream=None):
        rv = self._received
        if rv is None:
            raise InvalidArgument("row_routing: no dispatch has been received since construction or the last "
                                  "mask_ranks (or the last one failed)")
        n = rv.token.size
        indices[:] = -1
        indices[:n] = rv.local
        if weights is not None:
            weights[:] = 0
            if rv.weights is not None:
                weights[:n] = np.where(rv.local >= 0, rv.weights, 0)

    def write_sources(self, src_info, layout_range, add_counts=None, stream=None):
        rv = self._received
        if rv is None:
            raise InvalidArgument("source_layout: no dispatch has been received since construction or the last "
                                  "mask_ranks (or the last one failed)")
        expert, slot = rv.where
        src_info[:] = -1
        src_info[rv.where] = rv.token[rv.pair_j]
        at = (expert, rv.src_rank[rv.pair_j])
        count, first = np.zeros(layout_range.shape, np.int64), np.full(layout_range.shape, slot.size, np.int64)
        np.add.at(count, at, 1)
        np.minimum.at(first, at, slot)
        layout_range[:] = np.where(count > 0, first << 32 | count, 0)
        if add_counts is not None:
            add_counts += count.sum(axis=1, dtype=np.int32)

    def dispatch_backward(self, a, stream=None):
        cfg = self.cfg
        rv = _Received.from_origin(a.origin, cfg.max_num_tokens)
        part = np.zeros((rv.token.size, cfg.hidden_dim), np.float32)  # summed over this rank's experts
        np.add.at(part, rv.pair_j, a.grad[rv.where].astype(np.float32))
        rows, counts = self._to_groups(rv.src_rank, [rv.token[:, None], part])
        recv = self._exchange("dispatch_backward", rows, counts, plan=_stamp(a.call))
        acc = np.zeros((a.m, cfg.hidden_dim), np.float32)  # float32 partial rows (never on the combine wire)
        np.add.at(acc, self._tokens(recv, a.m, "dispatch_backward"),
                  np.ascontiguousarray(recv[:, 4:]).view(np.float32))
        a.out[:a.m] = acc.astype(a.out.dtype)

    def combine_backward(self, a, stream=None):
        cfg, T, H, K = self.cfg, self.cfg.max_num_tokens, self.cfg.hidden_dim, self.cfg.experts_per_token
        W, m = cfg.world_size, a.m
        per_rank, counts = self._per_rank(a.expert[:m].astype(np.int64))  # the pairs this rank sent
        tokens = np.arange(m, dtype=np.int32)[:, None]
        grad, weights = a.grad[:m].astype(np.float32), a.weights[:m].astype(np.float32)
        rows = np.concatenate([_records(tokens[sel], local, weights[sel], grad[sel]) for sel, local in per_rank])
        recv, src_counts = self._exchange("combine_backward", rows, counts, sources=True, plan=_stamp(a.call))
        token = np.ascontiguousarray(recv[:, :4]).view(np.int32)[:, 0].astype(np.int64)
        w = np.ascontiguousarray(recv[:, 4 + 4 * K:4 + 8 * K]).view(np.float32)
        g = np.ascontiguousarray(recv[:, 4 + 8 * K:]).view(np.float32).reshape(-1, H)
        row_of = np.full(W * T, -1, np.int64)  # received row of each (source rank, token)
        row_of[np.repeat(np.arange(W), src_counts) * T + token] = np.arange(token.size)
        rv = _Received.from_origin(a.origin, T)
        pair_src, pair_token = rv.src_rank[rv.pair_j], rv.token[rv.pair_j]
        row = row_of[pair_src * T + pair_token]
        status, reason = _OK, ""
        if (row < 0).any():  # told to the peers in the next exchange, so that every rank raises
            q = int(np.argmax(row < 0))
            status, reason = _BAD_ARG, (f"plan: rank {int(pair_src[q])} sent no gradient for its token "
                                        f"{int(pair_token[q])}, which the plan's origin holds: the ranks' plans differ")
            row = np.maximum(row, 0)
        gy = g[row]
        a.out_grad_y[rv.where] = (w[row, rv.pair_k][:, None] * gy).astype(a.out_grad_y.dtype)
        dots = np.einsum("ph,ph->p", gy, a.y[rv.where].astype(np.float32)).astype(np.float32)
        rows, counts = self._to_groups(pair_src, [pair_token.astype(np.int32)[:, None],
                                                  rv.pair_k.astype(np.int32)[:, None], dots[:, None]])
        recv = self._exchange("weights_backward", rows, counts, status, reason, call="combine_backward",
                              plan=_stamp(a.call))
        fields = np.ascontiguousarray(recv).view(np.int32).reshape(-1, 3)  # token, k, the dot's bits
        a.out_grad_weights[:m] = 0
        a.out_grad_weights[self._tokens(recv, m, "combine_backward"), fields[:, 1]] = fields[:, 2].view(np.float32)

    def _exchange(self, phase, rows, counts, status=_OK, reason="", sources=False, call=None, plan=0):
        """One exchange of ``rows`` (grouped by destination, ``counts`` [W]) in ``phase`` following the plan
        stamped ``plan``, raising on every rank when one's ``status`` is not OK (naming ``call``, default the
        phase); returns the received rows (and the counts per source)."""
        ex = self._exchanges[phase]
        pending, statuses, reasons = ex.post(rows, counts, status, reason, agree=plan)
        if pending is None:
            _raise_status(statuses, reasons, (status, reason) if status else None, call or phase)
        recv, src_counts = ex.finish(pending)
        return (recv, src_counts) if sources else recv

    @staticmethod
    def _tokens(recv, m, phase):
        """The tokens [n] int32 of ``recv`` (records starting with a token int32), checked to be below m."""
        token = np.ascontiguousarray(recv[:, :4]).view(np.int32)[:, 0]
        if (token >= m).any():
            raise InvalidArgument(f"{phase}: a peer sent a gradient for token {int(token.max())}, beyond m={m}: the "
                                  f"ranks' plans or bound_m differ")
        return token

    def skip_backward(self, phase, refusal, stream=None):
        self._exchanges[phase].refuse(refusal)

    def skip(self, halves, stream=None, refusal=None):
        """A posted send half's exchange is finished, what it receives dropped (its receive half first in
        ``halves``); then the first send half among them takes part as a header flagged with the refusal, no
        data, on its first exchange. (An error raised in an exchange ends a host call on every rank at once:
        it leaves nothing to skip.)"""
        if halves and halves[0] in ("dispatch_recv", "combine_recv"):
            attribute = "_dispatch_pending" if halves[0] == "dispatch_recv" else "_combine_pending"
            posted = getattr(self, attribute)
            setattr(self, attribute, None)
            if posted is not None:
                ex, pending, _ = posted
                ex.finish(pending)
        half = first_send(halves)
        if refusal is not None and half is not None:
            phase = half[:-len("_send")]
            first = "demand" if phase == "dispatch" and self.cfg.capacity is not None else phase  # the call's first
            self._exchanges[first].refuse(refusal)

    def set_mask(self, masked, generation, barrier):
        self._generation = generation
        barrier()
        self._masked[:] = False
        self._masked[list(masked)] = True
        live = [q for q in range(self.cfg.world_size) if not self._masked[q]]
        for ex in self._exchanges.values():
            ex.restart(live, generation)
        self._received = self._dispatch_pending = self._combine_pending = None
        barrier()

    def snapshot(self):
        times = None if self._times is None else {p: list(t) for p, t in self._times.items()}
        return snapshot(self._counters, *self._per_expert, self._bytes, self._ring, times,
                        tag_ring=self._tag_ring if self.cfg.num_tags else None,
                        gap_ring=self._gap_ring if self.cfg.score_gap else None)

    def set_expert_map(self, expert_map):
        self.expert_map = expert_map
        for ex in self._exchanges.values():
            ex.map_generation = expert_map.generation

    def destroy(self, collective):
        self._received = self._dispatch_pending = self._combine_pending = None


class HostTransport(Transport):
    """CPU ranks exchanging numpy arrays over an mpi4py communicator; its waits watch the bootstrap's
    departure notices (``departures``: :class:`moecomm._mpi.Departures`)."""
    name = "host"
    memory = "host"

    def __init__(self, comm, departures):
        self.comm, self.departures = comm, departures

    def new_alltoall(self, cfg, timeout_s, ident):
        return HostAllToAll(self.comm, self.departures, cfg, timeout_s, ident)

    def new_arrays(self, max_rows):
        return HostArrays(max_rows)

    def check_peers(self, nbytes, timeout_s):
        w, me = self.comm.Get_size(), self.comm.Get_rank()
        send = peer_pattern(me, np.arange(w), nbytes)
        recv = np.empty_like(send)
        reqs = [self.comm.Irecv(recv[s], source=s, tag=TAG_PEER_CHECK) for s in range(w)]
        reqs += [self.comm.Isend(send[d], dest=d, tag=TAG_PEER_CHECK) for d in range(w)]
        wait_all(reqs, list(range(w)) * 2, time.monotonic() + timeout_s, timeout_s, "peer_check", self.departures)
        expect = peer_pattern(np.arange(w), me, nbytes)
        wrong = [int(p) for p in np.nonzero((recv != expect).any(axis=1))[0]]
        if wrong:
            raise MoeCommError(f"peer_check: wrong bytes received from ranks {wrong}")

    def finalize(self, collective):
        self.comm = None

