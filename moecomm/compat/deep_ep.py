"""DeepEP's API on moecomm: a program written for ``deep_ep.Buffer`` runs with its import changed to ``from
moecomm.compat import deep_ep``. Low-latency mode:

    buffer = deep_ep.Buffer(group, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts), low_latency_mode=True)
    recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(
        x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=True)
    combined_x, event, hook = buffer.low_latency_combine(expert_y, topk_idx, topk_weights, handle)

Each (num_max_dispatch_tokens_per_rank, hidden, num_experts, top-k, FP8 format) gets a :class:`moecomm.AllToAll`
at its first call (collective, as DeepEP's calls are), in the padded layout DeepEP's low-latency kernels use:
``recv_x [num_local_experts, num_max_dispatch_tokens_per_rank * num_ranks, hidden]`` with counts per local
expert, each expert's rows grouped by source rank (``group_by_source``). ``use_fp8`` quantises inside
dispatch (``dispatch_wire``: e4m3 with a float32 scale per 128 values, ``round_scale`` powers of two,
``use_ue8m0`` four UE8M0 scales per int32), the scales' last two dimensions column-major as DeepEP returns them.
``return_recv_hook`` issues the send half; the hook runs the receive half (moecomm holds no SMs between them);
without it each call is one launch. The kernels run under DeepEP's profiler names
(``AllToAll(kernel_names="deep_ep")``), so DeepEP's tests' ``bench_kineto`` times them.
Calls captured into a CUDA graph (``torch.cuda.graph``) run under ``a2a.captured()``: the kernels pair the replays,
and a failed replayed call's combined rows are NaN. Every call runs on the current stream: the returned event is an
EventOverlap of it with ``async_finish``, else empty (as DeepEP's). The handle is DeepEP's five-tuple: each slot's
source token ``[L, T * R]`` int32 and per local expert and source rank ``(first slot << 32) | count`` int64 (the
source's slots are consecutive, sources in rank order: the dispatch's ``sources``, written by its receive half,
which also adds ``cumulative_local_expert_recv_stats``' counts; in the dispatch's own launch at world size 1), then
num_max_dispatch_tokens_per_rank, hidden and num_experts. The results live in two sets per shape, used in turn
(DeepEP's own rule in low-latency mode: a program holds at most two calls' results at once), so no call allocates
(bound_m is kept per token count). A dispatch left uncombined ends (``a2a.abort()``) when the next one begins; the
last handle may be combined again, as DeepEP allows (moecomm combines each dispatch once: the tokens are dispatched
again and the expert outputs moved to the new slots of their pairs, a dispatch's cost).
Refused with a moecomm InvalidArgument: LogFMT combine (``combine_wire="e4m3"`` is moecomm's FP8 combine), and
the wait-cost statistics.

DeepEP's normal (high-throughput, intranode) mode: ``get_dispatch_layout``, ``dispatch`` and ``combine`` with a
handle, on AllToAlls of moecomm's ranks layout (``layout="ranks"``: each token once per rank of its experts,
rows grouped by source rank in token order, so a routing places its rows alike every time and a cached dispatch
is a dispatch of the handle's routing). One AllToAll per (the ranks' most tokens, rounded up to a power of two;
hidden; routing by expert or by rank; bf16 or FP8 tokens), made at first use. The calls read counts on the host
(the rows each rank received, for DeepEP's rank_prefix_matrix; the tokens per local expert), as DeepEP's do
unless ``num_worst_tokens`` (then only the rows). torch is imported here only.
"""
import functools
from collections import deque
from typing import NamedTuple

import numpy as np
import torch

import moecomm

from .._arrays import _PLAIN
from .._errors import InvalidArgument
from ..alltoall import CombineArgs, DispatchArgs, SourceLayout
from ..torch import AllToAll as _Layer
from ..torch import plain_torch


class EventOverlap:
    """DeepEP's event wrapper: ``event`` a torch.cuda.Event recorded on the call's stream (None on CPU tensors);
    ``current_stream_wait()`` makes the current stream wait for it; as a context manager, on exit."""

    def __init__(self, event=None, extra_tensors=None):
        self.event, self.extra_tensors = event, extra_tensors

    def current_stream_wait(self):
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.current_stream_wait()


def _recorded(layer):
    """``layer.a2a.captured()`` while the current CUDA stream is being captured into a graph (CUDA graphs of
    DeepEP's calls, as serving engines capture them): the calls then keep nothing on the host, and the kernels
    pair their replays; otherwise nothing."""
    return layer.a2a.captured() if not layer._host and torch._C._cuda_isCurrentStreamCapturing() else _PLAIN


def _event(like, async_finish):
    """DeepEP's returned event: with ``async_finish``, an EventOverlap of the current stream's work so far (none
    for CPU tensors); without it, none (as DeepEP's: the call's work is on the current stream already)."""
    if not async_finish or like.device.type != "cuda":
        return EventOverlap()
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(like.device))
    return EventOverlap(event)


class _Handle(tuple):
    """DeepEP's handle (src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts), carrying
    the moecomm call it belongs to for low_latency_combine: its layer, bound_m and its tokens (``x``: what a
    repeated combine's new dispatch sends) and the output set its results are in."""

    def __new__(cls, fields, layer, bound_m, x, outputs):
        handle = super().__new__(cls, fields)
        handle.layer, handle.bound_m, handle.x, handle.outputs = layer, bound_m, x, outputs
        return handle


class _NormalHandle(tuple):
    """DeepEP's intranode handle (rank_prefix_matrix [ranks, ranks] int32: row i, column j the rows rank j got from
    ranks 0..i; then None for the channel matrices, None for recv_src_idx, is_token_in_rank, None for send_head:
    moecomm's ranks layout needs none of them), carrying what its combine and cached dispatch need: ``routing``
    (the ids dispatched: topk_idx, or rank r where is_token_in_rank), ``experts`` (their count), ``tokens`` (the
    AllToAll's max_num_tokens), ``every_rows`` (the rows each rank received), ``rows`` (this rank's: ``rank``'s)
    and the tokens dispatched (``x``, ``scales``)."""

    def __new__(cls, rank_prefix_matrix, is_token_in_rank, routing, experts, tokens, every_rows, rank, x, scales):
        handle = super().__new__(cls, (rank_prefix_matrix, None, None, None, is_token_in_rank, None))
        handle.routing, handle.experts, handle.tokens = routing, experts, tokens
        handle.every_rows, handle.rows = every_rows, every_rows[rank]
        handle.x, handle.scales = x, scales
        return handle


class Config:
    """DeepEP's ``deep_ep.Config`` (its normal-mode kernels' SMs and chunk sizes): accepted and kept; moecomm's
    kernels size themselves."""

    def __init__(self, num_sms=20, num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256,
                 num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=256):
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens


class _Outputs(NamedTuple):
    """One set of a layer's call outputs: count [L] int32, recv_x [L, T * R, hidden], scales (FP8: [L, hidden /
    128, T * R], else None), ``received`` as low_latency_dispatch returns them (recv_x, or recv_x and the scales'
    [L, T * R, hidden / 128] view), the handle's src_info [L, T * R] int32 and layout_range [L, R] int64, and
    combine's combined [T, hidden] bfloat16; ``kept``: the same fields as moecomm reads them (the layer's
    _kept: no reading per call), received and kept None."""
    count: object
    recv_x: object
    scales: object
    received: object
    src_info: object
    layout_range: object
    combined: object
    kept: object = None


_KEPT = ("count", "recv_x", "scales", "src_info", "layout_range", "combined")  # _Outputs.kept's fields


class Buffer:
    """DeepEP's ``deep_ep.Buffer`` in low-latency mode (its constructor's arguments; the byte counts are hints
    moecomm does not need: each AllToAll sizes its own symmetric buffers).

    Args:
        group: a torch.distributed process group, a :class:`moecomm.Communicator`, or None (``moecomm.init()``
            over MPI).
        num_nvl_bytes, num_rdma_bytes, num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl,
            explicitly_destroy: accepted as DeepEP takes them.
        low_latency_mode: DeepEP's; the normal-mode calls refuse ``num_rdma_bytes > 0`` without it (DeepEP's
            internode normal mode).
    """
    num_sms = 20  # DeepEP's class attribute (its normal-mode kernels' SMs; the low-latency calls ignore it)

    def __init__(self, group=None, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                 explicitly_destroy=False, **_):
        self._owned = not isinstance(group, moecomm.Communicator)
        self.comm = moecomm.init(comm=group) if self._owned else group
        self.group, self.rank, self.group_size = group, self.comm.rank, self.comm.world_size
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy = low_latency_mode, explicitly_destroy
        self._layers = {}  # {(tokens, hidden, experts, topk, wire, scale dtype): moecomm.torch layer}
        self._combine_buffers = {}  # {id(layer): its bf16 expert_y (zero-copy low-latency and normal combines)}
        self._counts = {}  # {(num_tokens, device): its bound_m}
        self._sets = {}  # {id(layer): its two output sets, the next first}
        self._masked = ()
        self._open = None  # the handle of the low-latency dispatch not combined yet
        self._last = None  # the handle of the last low-latency dispatch
        self._normal_open = None  # (layer, routing) of the normal-mode dispatch not combined yet

    @staticmethod
    def set_num_sms(new_num_sms):
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
        """Bytes of symmetric memory moecomm allocates per rank for this shape with FP8 dispatch (top-k 8, the
        gradient rows the handle's source info needs included): DeepEP's hint, for reporting."""
        from .._config import AllToAllConfig
        from ..transport.gpu_alltoall import symmetric_bytes
        cfg = AllToAllConfig.create(num_ranks, 0, num_max_dispatch_tokens_per_rank, num_experts,
                                    min(8, num_experts), hidden, None, "bfloat16", "bfloat16", None, 1,
                                    gradients=True, dispatch_wire="e4m3")
        return symmetric_bytes(cfg)

    # the low-latency calls ----------------------------------------------------------------------
    def _layer(self, tokens, hidden, num_experts, topk, use_fp8, round_scale, use_ue8m0):
        if use_ue8m0 and not round_scale:
            raise InvalidArgument("low_latency_dispatch: use_ue8m0 needs round_scale=True (as in DeepEP)")
        wire = None if not use_fp8 else "e4m3_ue8m0" if round_scale else "e4m3"
        scale_dtype = None if not use_fp8 else "ue8m0x4" if use_ue8m0 else "float32"
        key = (tokens, hidden, num_experts, topk, wire, scale_dtype)
        if key not in self._layers:
            a2a = moecomm.AllToAll(self.comm, tokens, num_experts, topk, hidden, None, "bfloat16", "bfloat16",
                                   scale_dtype=scale_dtype, scale_layout="column" if use_fp8 else "row",
                                   dispatch_wire=wire, gradients=True, kernel_names="deep_ep", group_by_source=True)
            if self._masked:
                a2a.mask_ranks(self._masked)
            self._layers[key] = _Layer(a2a)
        return self._layers[key]

    def _outputs(self, layer, like):
        """The next of ``layer``'s two output sets (:class:`_Outputs`, made at first use on like's device), in
        turn: DeepEP's low-latency results live in its buffers, so a program holds at most two calls' results at
        once (DeepEP's rule); no call allocates."""
        sets = self._sets.get(id(layer))
        if sets is None:
            c, new, T = layer.a2a.cfg, layer._new, layer.a2a.cfg.max_num_tokens
            sets = self._sets[id(layer)] = deque()
            for _ in range(2):
                recv_x = new(c.expert_x_shape(), c.expert_dtype, like, False)
                scales = new(c.expert_x_scale_shape(), c.scale_dtype, like, False) if c.hidden_dim_scale else None
                outs = _Outputs(
                    new((c.num_local_experts,), np.int32, like, False), recv_x, scales,
                    recv_x if scales is None else (recv_x, scales.transpose(1, 2)),  # scales: column-major
                    new(c.expert_x_shape()[:-1], np.int32, like, False),
                    torch.empty((c.num_local_experts, self.group_size), dtype=torch.int64, device=like.device),
                    torch.empty((T, c.hidden_dim), dtype=torch.bfloat16, device=like.device))
                kept = outs._replace(**{f: layer._kept(getattr(outs, f)) for f in _KEPT}, received=None)
                sets.append(outs._replace(kept=kept))
        sets.rotate()
        return sets[0]

    def _bound_m(self, n, layer, device):
        """A [1] int32 tensor holding n on ``device``, made once (a fill: no host copy) and never written again,
        so that a handle may keep it: as ``layer`` reads it (its _kept)."""
        key = (n, device)
        if key not in self._counts:
            self._counts[key] = layer._kept(torch.full((1,), n, dtype=torch.int32, device=device))
        return self._counts[key]

    @plain_torch
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False,
                             return_recv_hook=False):
        """DeepEP's low_latency_dispatch: x [num_tokens, hidden] bfloat16, topk_idx [num_tokens, top-k] int64 (-1:
        none), num_tokens <= num_max_dispatch_tokens_per_rank. Returns (recv_x, or (recv_x e4m3, scales) with
        use_fp8; recv_count [L] int32; handle; event (with ``async_finish``, as DeepEP's); hook or None)."""
        if dispatch_wait_recv_cost_stats is not None:
            raise InvalidArgument("low_latency_dispatch: dispatch_wait_recv_cost_stats is not provided by moecomm "
                                  "(a2a.stats() keeps per-call counts and, with timing=True, times)")
        if self._open is not None:  # DeepEP lets a dispatch go uncombined: its call ends here, on every rank alike
            self._open.layer.a2a.abort()
            self._open = None
        tokens, hidden = x.shape
        layer = self._layer(num_max_dispatch_tokens_per_rank, hidden, num_experts, topk_idx.shape[1], use_fp8,
                            round_scale, use_ue8m0)
        a2a, stats = layer.a2a, cumulative_local_expert_recv_stats
        if stats is not None and (stats.dtype != torch.int32 or stats.shape != (a2a.cfg.num_local_experts,)):
            raise InvalidArgument(f"low_latency_dispatch: cumulative_local_expert_recv_stats is {stats.dtype} "
                                  f"{list(stats.shape)}; DeepEP's is int32 [{a2a.cfg.num_local_experts}] (the local "
                                  f"experts)")  # before any call: every rank refuses alike
        stats = layer._arg(stats)
        bound_m = self._bound_m(tokens, layer, x.device)
        outs = self._outputs(layer, x)
        kept = outs.kept
        stream = layer._stream(x)
        sources = SourceLayout(kept.src_info, kept.layout_range, stats)  # the handle's, written by the receive half
        args = DispatchArgs(kept.count, kept.recv_x, kept.scales, layer._arg(x), None, layer._arg(topk_idx), bound_m,
                            stream=stream, sources=sources)

        receive = None
        if return_recv_hook:
            @plain_torch
            def receive():  # the receive half and the handle's arrays, on the stream current when it is called
                with _recorded(layer):
                    a2a.run(args._replace(stream=layer._stream(x)), do_send=False)

            with _recorded(layer):
                a2a.run(args._replace(sources=None), do_recv=False)
        else:  # one launch, as DeepEP's
            with _recorded(layer):
                a2a.run(args)
        handle = self._open = self._last = _Handle(
            (outs.src_info, outs.layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts), layer,
            bound_m, x, outs)
        return outs.received, outs.count, handle, _event(x, async_finish), receive

    @plain_torch
    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False,
                            async_finish=False, return_recv_hook=False, out=None,
                            combine_wait_recv_cost_stats=None):
        """DeepEP's low_latency_combine: x [L, T * R, hidden] bfloat16 expert outputs (ignored with zero_copy:
        the buffer of get_next_low_latency_combine_buffer), topk_idx and topk_weights [num_tokens, top-k] as
        dispatched. Returns (combined_x [num_tokens, hidden] bfloat16 (``out`` when given), event (with
        ``async_finish``), hook or None)."""
        if handle is not self._last:
            raise InvalidArgument("low_latency_combine: another dispatch came after this handle's: moecomm combines "
                                  "the last dispatch")
        layer = handle.layer
        a2a, arg = layer.a2a, layer._arg
        refusal = ("LogFMT is not provided by moecomm: AllToAll(combine_wire='e4m3') is its FP8 combine"
                   if use_logfmt else "combine_wait_recv_cost_stats is not provided by moecomm"
                   if combine_wait_recv_cost_stats is not None else None)
        if refusal:
            a2a.abort()  # the dispatch's call ends on every rank (each refuses alike)
            raise InvalidArgument(f"low_latency_combine: {refusal}")
        y = self._combine_buffers[id(layer)] if zero_copy else x
        again = handle is not self._open  # combined already (DeepEP lets a handle combine again): moecomm
        if again:  # combines each dispatch once
            y = self._dispatch_again(handle, topk_idx, y)
        self._open = None
        combined, full = out, handle.outputs.combined
        if combined is None:  # the handle's set's rows (a view where fewer; a combine again: rows of its own)
            tokens = topk_idx.shape[0]
            combined = (torch.empty_like(full[:tokens]) if again else
                        full if tokens == full.shape[0] else full[:tokens])
        args = CombineArgs(handle.outputs.kept.combined if combined is full else arg(combined), arg(topk_idx),
                           arg(topk_weights), arg(y), handle.bound_m, stream=layer._stream(topk_idx))
        with _recorded(layer):
            a2a.run(args, do_recv=not return_recv_hook)  # one launch without the hook, as DeepEP's
        hook = None
        if return_recv_hook:
            @plain_torch
            def hook():  # on the stream current when it is called
                with _recorded(layer):
                    a2a.run(args._replace(stream=layer._stream(topk_idx)), do_send=False)
        return combined, _event(combined, async_finish), hook

    def _dispatch_again(self, handle, topk_idx, y):
        """Dispatch ``handle``'s tokens again along ``topk_idx`` (its routing) into scratch outputs, so that its
        call can be combined once more; returns its expert outputs y [L, T * R, hidden] moved to the new
        dispatch's slots of their pairs (arrival order may place them differently). A pair is its (source rank,
        token) within an expert (a token reaches an expert once), as the handles' source layouts give them."""
        layer = handle.layer
        a2a, c, new, x = layer.a2a, layer.a2a.cfg, layer._new, handle.x
        scales = new(c.expert_x_scale_shape(), c.scale_dtype, x, False) if c.hidden_dim_scale else None
        args = (new((c.num_local_experts,), np.int32, x, False), new(c.expert_x_shape(), c.expert_dtype, x, False),
                scales, x, None, topk_idx)
        src_info, layout_range = torch.empty_like(handle[0]), torch.empty_like(handle[1])
        a2a.run(DispatchArgs(*map(layer._arg, args), handle.bound_m,
                             sources=SourceLayout(layer._arg(src_info), layer._arg(layout_range))))
        return _moved(y, _pairs(handle[0], handle[1]), _pairs(src_info, layout_range))

    @plain_torch
    def get_next_low_latency_combine_buffer(self, handle):
        """The bf16 [L, T * R, hidden] tensor a zero-copy low_latency_combine of this handle's AllToAll reads."""
        return self._combine_buffer(handle.layer, handle[0].device)

    def _combine_buffer(self, layer, device):
        """The layer's bf16 expert_y (its config's expert_x_shape(): [L, T * R, hidden] low-latency, [capacity,
        hidden] normal mode), zeros, made once: what a zero-copy low-latency combine reads, and where a
        normal-mode combine copies its x when it cannot read x in place (_in_place)."""
        y = self._combine_buffers.get(id(layer))
        if y is None:
            y = self._combine_buffers[id(layer)] = torch.zeros(layer.a2a.cfg.expert_x_shape(), dtype=torch.bfloat16,
                                                               device=device)
        return y

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """Nothing to clean: moecomm's buffers carry the call each word belongs to."""

    # masking (DeepEP's elastic low-latency mode) ----------------------------------------------------
    def low_latency_update_mask_buffer(self, rank_to_mask, mask=False):
        """Mask (``mask=True``) or unmask ``rank_to_mask`` in every AllToAll of this buffer, now and later
        (moecomm.AllToAll.mask_ranks: collective among the unmasked ranks)."""
        masked = set(self._masked) | {rank_to_mask} if mask else set(self._masked) - {rank_to_mask}
        self._masked = tuple(sorted(masked))
        for layer in self._layers.values():
            layer.a2a.mask_ranks(self._masked)

    def low_latency_query_mask_buffer(self, mask_status):
        """Write 1 for each masked rank, 0 elsewhere, into mask_status [num_ranks] int32."""
        mask_status.zero_()
        for r in self._masked:
            mask_status[r] = 1

    def low_latency_clean_mask_buffer(self):
        """Unmask every rank."""
        self._masked = ()
        for layer in self._layers.values():
            layer.a2a.mask_ranks(())

    # normal mode: DeepEP's intranode high-throughput API on moecomm's ranks layout -----------------------------
    @staticmethod
    def is_sm90_compiled():
        """True: moecomm takes FP8 tokens with their scales (DeepEP's test asks before it makes FP8 inputs)."""
        return True

    @staticmethod
    def get_dispatch_config(num_ranks):
        """A :class:`Config` (DeepEP's tuning, which moecomm takes and does not need)."""
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks):
        """As :meth:`get_dispatch_config`."""
        return Config(Buffer.num_sms)

    @staticmethod
    def capture():
        """An EventOverlap of the current CUDA stream's work so far (DeepEP's ``previous_event``); empty without
        CUDA."""
        if not torch.cuda.is_available():
            return EventOverlap()
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return EventOverlap(event)

    def _normal(self, what, previous_event):
        """Refuse DeepEP's internode normal mode; make the current stream wait for ``previous_event``."""
        if self.num_rdma_bytes and not self.low_latency_mode:
            raise InvalidArgument(f"{what}: DeepEP's internode normal mode (num_rdma_bytes > 0) is not provided by "
                                  f"moecomm.compat.deep_ep: make the Buffer with num_rdma_bytes=0 (intranode)")
        if previous_event is not None:
            previous_event.current_stream_wait()

    def _end_normal(self):
        """End the normal-mode call left open (no combine follows it), on this rank; the others do alike."""
        if self._normal_open is not None:
            self._normal_open[0].a2a.abort()
            self._normal_open = None

    @plain_torch
    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        """DeepEP's get_dispatch_layout: topk_idx [num_tokens, top-k] int64 (-1: none). Returns (num_tokens_per_rank
        [ranks] int32, None (intranode: no RDMA ranks), num_tokens_per_expert [num_experts] int32,
        is_token_in_rank [num_tokens, ranks] bool, event): torch operations on topk_idx's device."""
        self._normal("get_dispatch_layout", previous_event)
        W = self.group_size
        valid = topk_idx >= 0
        per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
        owner = torch.where(valid, topk_idx // (num_experts // W), -1)
        in_rank = (owner.unsqueeze(-1) == torch.arange(W, device=topk_idx.device)).any(dim=1)
        return in_rank.sum(0, dtype=torch.int32), None, per_expert, in_rank, _event(topk_idx, async_finish)

    def _ranks_layer(self, tokens, hidden, num_experts, topk, scales):
        """The moecomm.torch layer of an AllToAll in the ranks layout for this routing (num_experts, topk) and
        token format (bfloat16, or e4m3 with ``scales``' float32 columns), made at first use (collective, as
        DeepEP's calls are)."""
        key = ("ranks", tokens, hidden, num_experts, topk, None if scales is None else scales.size(1))
        if key not in self._layers:
            if scales is not None and scales.dtype != torch.float32:
                raise InvalidArgument(f"dispatch: FP8 scales of {scales.dtype}: moecomm.compat.deep_ep's normal mode "
                                      f"takes float32 scales")
            fp8 = scales is not None
            a2a = moecomm.AllToAll(self.comm, tokens, num_experts, topk, hidden, scales.size(1) if fp8 else None,
                                   "float8_e4m3fn" if fp8 else "bfloat16", "bfloat16", layout="ranks")
            self._layers[key] = _Layer(a2a)
        return self._layers[key]

    @plain_torch
    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False):
        """DeepEP's normal-mode dispatch: each token once to every rank of its experts (topk_idx [num_tokens,
        top-k] int64), or of is_token_in_rank [num_tokens, ranks] bool without topk_idx, or as ``handle``'s
        dispatch did (the cached dispatch). x: [num_tokens, hidden] bfloat16, or (e4m3 [num_tokens, hidden],
        float32 scales [num_tokens, hidden / 128]). Returns (recv_x [n, hidden] (or the pair), recv_topk_idx
        [n, top-k] int64 (local expert ids, -1 elsewhere) and recv_topk_weights [n, top-k] float32 with topk_idx
        (else None), the tokens per local expert (a list, each rounded up to expert_alignment; [] with
        num_worst_tokens, which n then is), handle, event); a cached dispatch returns (recv_x, None, None, None,
        None, event). recv_x's rows: sources in rank order, each source's tokens in token order."""
        self._normal("dispatch", previous_event)
        x, scales = x if isinstance(x, tuple) else (x, None)
        cached = handle is not None
        if cached:
            if topk_idx is not None or topk_weights is not None:
                raise InvalidArgument("dispatch: a cached dispatch (handle given) takes no topk_idx or topk_weights")
            routing, experts, tokens = handle.routing, handle.experts, handle.tokens
        elif topk_idx is not None:  # routed by expert: row_routing gives each row's top-k
            if num_tokens_per_expert is None:
                raise InvalidArgument("dispatch: num_tokens_per_expert (get_dispatch_layout) is required")
            routing, experts = topk_idx, num_tokens_per_expert.numel()
        elif is_token_in_rank is not None and num_tokens_per_expert is not None:  # by rank: "expert" r is rank r
            ranks = torch.arange(self.group_size, device=x.device, dtype=torch.int64)
            routing, experts = torch.where(is_token_in_rank, ranks, -1), self.group_size
        else:
            raise InvalidArgument("dispatch: give is_token_in_rank and num_tokens_per_expert (get_dispatch_layout), "
                                  "topk_idx, or a handle")
        if not cached:  # the AllToAll holds the most tokens of any rank (rounded up to a power of two)
            most = max(self.comm.allgather(x.size(0), "deep_ep dispatch: the ranks' token counts"))
            tokens = 1 << max(most - 1, 0).bit_length()
        layer = self._ranks_layer(tokens, x.size(1), experts, routing.size(1), scales)
        a2a, arg, c = layer.a2a, layer._arg, layer.a2a.cfg
        if num_worst_tokens > c.expert_capacity:
            raise InvalidArgument(f"dispatch: num_worst_tokens={num_worst_tokens} exceeds the worst case, "
                                  f"{c.expert_capacity} rows (the most tokens of a rank, rounded up, x ranks)")
        self._end_normal()  # DeepEP lets a dispatch go uncombined: its call ends here
        new = functools.partial(torch.empty, device=x.device)
        count, recv_x = new((c.num_local_experts,), dtype=torch.int32), new(c.expert_x_shape(), dtype=x.dtype)
        recv_scales = None if scales is None else new(c.expert_x_scale_shape(), dtype=scales.dtype)
        offsets = new((self.group_size + 1,), dtype=torch.int32)
        a2a.dispatch(arg(count), arg(recv_x), arg(recv_scales), arg(x.contiguous()),
                     arg(None if scales is None else scales.contiguous()), arg(routing),
                     self._bound_m(x.size(0), layer, x.device),
                     weights=arg(None if topk_weights is None else topk_weights.float().contiguous()),
                     out_expert_offsets=arg(offsets))
        self._normal_open = (layer, routing)
        if not cached:  # every rank's rows from each source: DeepEP's rank_prefix_matrix (and this rank's rows)
            columns = self.comm.allgather(offsets.cpu().numpy()[1:], "deep_ep dispatch: the ranks' rows")
            prefix = torch.tensor(np.stack(columns, axis=1), dtype=torch.int32, device=x.device)
            handle = _NormalHandle(prefix, is_token_in_rank, routing, experts, tokens,
                                   [int(column[-1]) for column in columns], self.rank, x, scales)
        if num_worst_tokens and max(handle.every_rows) > num_worst_tokens:  # every rank knows: refused alike
            self._end_normal()
            most = handle.every_rows.index(max(handle.every_rows))
            raise InvalidArgument(f"dispatch: rank {most} received {handle.every_rows[most]} rows, more than "
                                  f"num_worst_tokens={num_worst_tokens}")
        n = num_worst_tokens or handle.rows
        received = recv_x[:n] if scales is None else (recv_x[:n], recv_scales[:n])
        event = _event(x, async_finish)
        if cached:
            return received, None, None, None, None, event
        recv_idx = recv_w = None
        if topk_idx is not None:
            shape = (c.expert_capacity, c.experts_per_token)
            recv_idx, recv_w = new(shape, dtype=torch.int64), new(shape, dtype=torch.float32)
            a2a.row_routing(arg(recv_idx), arg(recv_w))
            recv_idx, recv_w = recv_idx[:n], recv_w[:n]
            per_expert = count.tolist()  # pairs per local expert: the tokens each expert gets
        else:  # the ranks' counts for this rank's experts
            every = self.comm.allgather(num_tokens_per_expert.cpu().numpy(), "deep_ep dispatch: the experts' tokens")
            L = num_tokens_per_expert.numel() // self.group_size
            per_expert = np.sum(every, axis=0)[self.rank * L:(self.rank + 1) * L].tolist()
        a = expert_alignment
        per_expert = [] if num_worst_tokens else [-(-int(v) // a) * a for v in per_expert]
        return received, recv_idx, recv_w, per_expert, handle, event

    @plain_torch
    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        """DeepEP's normal-mode combine: x [n, hidden] bfloat16, a row per row of ``handle``'s dispatch (rows past
        its n are ignored; read in place where its storage allows, else copied once: _in_place); topk_weights
        [n, top-k] float32 or None; bias: one or two [num_tokens, hidden] bfloat16 tensors added, or None.
        Returns (combined_x [num_tokens, hidden] bfloat16: each token's rows summed over the ranks that received
        it, combined_topk_weights [num_tokens, top-k] float32 (summed alike) or None, event). A dispatch of the
        handle's routing is combined: the last one if it had that routing (the handle's own, or a cached dispatch
        of it), else the handle's tokens are dispatched again first (a dispatch's cost)."""
        self._normal("combine", previous_event)
        if not isinstance(handle, _NormalHandle):
            raise InvalidArgument("combine: the handle of a normal-mode dispatch of this Buffer")
        if x.dtype != torch.bfloat16:
            raise InvalidArgument(f"combine: x is {x.dtype}; DeepEP's normal-mode combine takes bfloat16")
        if self._normal_open is None or self._normal_open[1] is not handle.routing:
            self.dispatch(handle.x if handle.scales is None else (handle.x, handle.scales), handle=handle)
        layer, _ = self._normal_open
        a2a, arg, c = layer.a2a, layer._arg, layer.a2a.cfg
        rows, T, K = handle.rows, handle.x.size(0), c.experts_per_token
        H = c.hidden_dim
        if (x.dim() != 2 or x.size(0) < rows or x.size(1) != H
                or (topk_weights is not None and tuple(topk_weights.shape[1:]) != (K,))):
            self._end_normal()
            raise InvalidArgument(f"combine: x {list(x.shape)} and topk_weights [.., {K}] for the handle's {rows} "
                                  f"rows of hidden {H} and top-k {K}")
        y = _in_place(x, c.expert_x_shape())
        if y is None:  # copied into the layer's expert_y
            y = self._combine_buffer(layer, x.device)
            y[:rows].copy_(x[:rows])
        out = torch.empty((T, H), dtype=torch.bfloat16, device=x.device)
        side = combined_w = None
        if topk_weights is not None:
            side = torch.zeros((c.expert_capacity, K), dtype=torch.float32, device=x.device)
            side[:rows].copy_(topk_weights[:rows])
            combined_w = torch.empty((T, K), dtype=torch.float32, device=x.device)
        self._normal_open = None
        a2a.combine(arg(out), arg(handle.routing), None, arg(y), self._bound_m(T, layer, x.device),
                    expert_weights=arg(side), out_weights=arg(combined_w))
        for b in bias if isinstance(bias, (tuple, list)) else (bias,):
            if b is not None:
                out += b
        return out, combined_w, _event(out, async_finish)

    def destroy(self):
        """Destroy the AllToAlls (and the communicator this buffer made)."""
        for layer in self._layers.values():
            layer.a2a.destroy()
        self._layers.clear()
        if self._owned:
            self.comm.finalize()


def _in_place(x, shape):
    """x [n, hidden] (checked by the caller) seen as ``shape`` ([capacity, hidden], a normal-mode layer's
    expert_y) without a copy, where it is contiguous and its storage holds that many rows from its first (n =
    capacity, or a view of a dispatch's recv_x): the combine reads only the handle's rows, all below n. None
    where it cannot be."""
    capacity, hidden = shape
    held = x.untyped_storage().nbytes() // x.element_size() - x.storage_offset()
    if not x.is_contiguous() or held < capacity * hidden:  # values from its first
        return None
    return x.as_strided(shape, (hidden, 1))


def _pairs(src_info, layout_range):
    """[L, S] int64: each slot's pair as (source rank << 32) | token, -1 where empty, from a handle's src_info
    [L, S] and layout_range [L, ranks] (each source's slots consecutive, sources in rank order from slot 0)."""
    ends = (layout_range & 0xFFFFFFFF).cumsum(1)
    slots = torch.arange(src_info.size(1), device=src_info.device).expand(src_info.size(0), -1).contiguous()
    source = torch.searchsorted(ends, slots, right=True)
    return torch.where(src_info >= 0, source << 32 | src_info.long(), -1)


def _moved(y, before, after):
    """Expert outputs y [L, S, hidden] laid out by the slots' pairs ``before`` [L, S] int64 (-1 where empty),
    moved to the slots that hold the same pairs in ``after``."""
    ordered, slot = before.sort(dim=1)
    at = torch.searchsorted(ordered, after).clamp(max=before.size(1) - 1)
    source = slot.gather(1, at)  # the old slot of each new slot's pair
    moved = y.gather(1, source.unsqueeze(-1).expand_as(y))
    return torch.where((after >= 0).unsqueeze(-1), moved, torch.zeros((), dtype=y.dtype, device=y.device))
