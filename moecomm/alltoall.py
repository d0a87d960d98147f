"""The public dispatch/combine API, after pplx-kernels' ``AllToAll`` (framework-neutral)."""
import hashlib
import warnings
from contextlib import contextmanager, nullcontext, suppress
from operator import is_
from typing import NamedTuple

import numpy as np

from . import _constants as C
from ._arrays import Accepted, accepted, torch_function_off
from ._calls import CallOrder
from ._config import AllToAllConfig
from ._constants import ARGUMENTS, HALVES, m_in_range, timeout_seconds
from ._dtypes import bfloat16, float16, float32
from ._errors import CommTimeout, InvalidArgument, MoeCommError, OutOfStep
from .comm import one_call

# expert ids: uint32 is read as int32, as the kernels read it (0xffffffff is -1: no expert)
_INDICES = Accepted({np.dtype(np.int32): np.dtype(np.int32), np.dtype(np.uint32): np.dtype(np.int32),
                     np.dtype(np.int64): np.dtype(np.int64)}, "int32, uint32 or int64")
_BOUND_M = accepted(np.int32, np.uint32)
_COUNTS = accepted(np.int32)
_RANGES = accepted(np.int64)
_FLAGS = accepted(np.uint8)
_FLOAT32 = accepted(float32)
_GRAD = accepted(bfloat16, float16, float32)  # gradients: the caller's float dtype
_ONE = (1,)
_TAGS = (None,)  # tags: a row per token


class SourceLayout(NamedTuple):
    """Where a dispatch put each source rank's rows, as DeepEP's low-latency handle describes them (its
    ``src_info`` and ``layout_range``), in the padded layout whose experts' slots are grouped by source rank
    (``group_by_source=True``, or world size 1): the arrays :meth:`AllToAll.source_layout` writes, given to
    :meth:`AllToAll.dispatch` (``sources=``) to be written by the dispatch's receive half itself.

    Attributes:
        out_src_info: [num_local_experts, expert_capacity] int32, written: the token (its row in the source
            rank's dp_x) each slot holds, -1 where empty.
        out_layout_range: [num_local_experts, world_size] int64, written: ``(first slot << 32) | slots`` of
            each source rank's rows in each expert (consecutive, sources in rank order); 0 where none.
        add_counts: [num_local_experts] int32, or None: each local expert's received tokens (its slots
            written) added to it, as DeepEP's ``cumulative_local_expert_recv_stats``.
    """
    out_src_info: object
    out_layout_range: object
    add_counts: object = None


class DispatchArgs(NamedTuple):
    """The arrays of one dispatch call, as :meth:`AllToAll.dispatch` takes them (shapes and dtypes there).
    ``moved_outputs``: a receive half may be given other output arrays than its send half, holding what
    the send half wrote (``moecomm.jax``: XLA may copy a buffer between the halves). ``promised``: the caller
    promises that these arrays come back call after call with the same address, shape, dtype and layout
    (:meth:`AllToAll.prepare_dispatch`): a call given the same objects as its phase's last checks that
    instead of reading them again, and is refused where one changed. ``sources``: a :class:`SourceLayout`
    the call's receive half also writes (:meth:`AllToAll.dispatch`), or None."""
    out_expert_num_tokens: object
    out_expert_x: object
    out_expert_x_scale: object
    dp_x: object
    dp_x_scale: object
    indices: object
    bound_m: object
    weights: object = None
    out_expert_offsets: object = None
    tags: object = None
    call_id: object = None
    stream: object = None
    moved_outputs: bool = False
    promised: bool = False
    sources: object = None
    phase = "dispatch"  # class attributes, not fields
    array_fields = ("out_expert_num_tokens", "out_expert_x", "out_expert_x_scale", "dp_x", "dp_x_scale", "indices",
                    "bound_m", "weights", "out_expert_offsets", "tags", "call_id")  # what a call's reading reads

    @property
    def first(self):
        """The array whose framework gives the stream when ``stream`` is None."""
        return self.dp_x


class CombineArgs(NamedTuple):
    """The arrays of one combine call, as :meth:`AllToAll.combine` takes them (shapes and dtypes there);
    ``promised`` as in :class:`DispatchArgs` (:meth:`AllToAll.prepare_combine`); ``zero_tail``: rows m..rows-1
    of out_tokens (rows: the fewest of the per-token arrays) are written too, as zeros, and on GPUs all of its
    rows where the kernels find the call failed, for a framework whose output buffers start uninitialised
    (``moecomm.jax``, ``moecomm.torch``); combine() leaves them as they were. ``nan_failed`` (GPUs; the
    default, as in combine()): where the kernels find the call failed, on this rank or on a rank it combines
    from, every row of out_tokens is NaN instead, so that a call whose error is raised after its rows were read
    (GPU calls raise once the call is over, at the next call or synchronize()) or never by the call itself (a
    graph replayed) never returns plausible rows (the streamed combine of prefill-sized batches sums its
    tokens before it hears from every rank: there a peer's failure leaves its rows as summed). False: zeros
    with zero_tail, else the rows as they were. The host transport raises in the call instead. ``expert_weights``
    and ``out_weights``: the ranks layout's float32 side rows (:meth:`AllToAll.combine`)."""
    out_tokens: object
    indices: object
    weights: object
    expert_y: object
    bound_m: object
    out_dropped: object = None
    expert_weights: object = None
    out_weights: object = None
    stream: object = None
    promised: bool = False
    zero_tail: bool = False
    nan_failed: bool = True
    phase = "combine"
    array_fields = ("out_tokens", "indices", "weights", "expert_y", "bound_m", "out_dropped", "expert_weights",
                    "out_weights")

    @property
    def first(self):
        return self.out_tokens


# A call's arrays lead its fields, so that AllToAll._read compares a call's with its phase's last in one pass.
assert all(a._fields[:len(a.array_fields)] == a.array_fields for a in (DispatchArgs, CombineArgs))

_new_tuple = tuple.__new__  # the call path makes its records with it: a NamedTuple's constructor costs ~1 us


class _Seen(NamedTuple):
    """A phase's last call whose arrays were read into its call record, which no call has changed since, and
    were all DeviceBuffers (immutable) or promised (DispatchArgs.promised): a call given the same objects
    again is not read again (AllToAll._read); promised arrays are checked against their ``marks`` first."""
    arrays: tuple   # the call's arrays (DispatchArgs.array_fields, CombineArgs.array_fields), in that order
    weights: bool   # whether router weights were given
    outputs: tuple  # dispatch: its output arrays' addresses (None for combine)
    marks: tuple    # promised arrays: ((name, array, its fingerprint), ...) to check; () for DeviceBuffers
    producers: frozenset  # the producers the reading found (streams the launch stream waits for)


class PreparedCall:
    """One phase's call with its arrays given once (:meth:`AllToAll.prepare_dispatch`,
    :meth:`AllToAll.prepare_combine`), run by calling it: ``call(do_send=True, do_recv=True)`` is
    ``a2a.dispatch`` / ``a2a.combine`` with those arrays, and raises the same errors. The first run reads and
    checks the arrays as any call does; later runs check only that each array keeps the address, shape, dtype
    and layout it had then (CuPy arrays and torch tensors by their attributes; DeviceBuffers are immutable;
    other kinds are read every time) and refuse the call, on every rank, where one changed. The arrays' contents
    are the caller's to write between runs, as always."""

    __slots__ = ("_a2a", "args")

    def __init__(self, a2a, args):
        self._a2a, self.args = a2a, args

    def __call__(self, do_send=True, do_recv=True):
        self._a2a.run(self.args, do_send, do_recv)


class Refusal(NamedTuple):
    """Why a rank takes part in a call with no data: ``text`` (its error's message) and ``code`` (the reason
    its signals carry to the peers: an ERR_* code, ERR_REFUSED with the argument's number)."""
    text: str
    code: int


class RoutingPlan(NamedTuple):
    """Where a dispatch put each (token, expert) pair, as arrays the caller keeps (:meth:`AllToAll.plan`
    writes them; :meth:`AllToAll.plan_shapes` gives their shapes), so that the backward of that dispatch and
    its combine, run later, follow the same placement (slots are filled in arrival order, so another dispatch
    of the same tokens may place them differently).

    Attributes:
        expert: [max_num_tokens, experts_per_token] int32, the physical expert each pair this rank sent went
            to; -1 for a -1 id, a pair not sent (its expert's rank masked, dropped for capacity, or sent by
            another rank of the DP group) and rows >= m.
        origin: out_expert_x's shape without its last dimension, then 3: int32 (source rank, token,
            top-k position) of the pair each slot (padded) or row (packed) holds; -1 where empty.
        call: [2] int32, the forward call it describes (the AllToAll's restart generation, the dispatch's
            number): the backward calls check that every rank passes the plan of the same call.
        held: [1 + slots] int32 (slots: origin's size / 3): held[0] = n, the slots (padded) or rows (packed)
            that hold a pair, and held[1 .. n] those slots in the order plan() wrote them (the backward
            kernels share them out evenly instead of scanning every slot; on GPUs a dispatched record's
            slots stand together, and dispatch_backward sums them so); the rest unspecified.
        local: [max_num_tokens, experts_per_token] int32, the slot (padded) or row (packed) of each pair this
            rank sent to one of its own experts (as held lists them); -1 elsewhere. The backward calls read a
            rank's own tokens' slots there instead of passing them through its buffers.
    """
    expert: object
    origin: object
    call: object
    held: object
    local: object


class _Backward(NamedTuple):
    """The arrays of a backward call as the backend reads them (numpy on the host transport, device addresses
    on GPUs): m (read on the host transport; None on GPUs, whose kernels read bound_m), bound_m, rows (the
    fewest rows of the per-token arrays), the plan's arrays, the gradient ``grad`` and its dtype, the written
    output (``out`` or ``out_grad_y``) and its dtype, and the others of combine_backward."""
    m: object
    bound_m: object
    rows: int
    expert: object
    origin: object
    call: object
    held: object
    local: object
    grad: object
    grad_dtype: object
    out_dtype: object
    out: object = None
    out_grad_y: object = None
    out_grad_weights: object = None
    weights: object = None
    y: object = None


class AllToAll:
    """Expert-parallel dispatch and combine over a :class:`moecomm.Communicator`.

    Construction is collective: every rank must pass the same configuration (checked; a mismatch raises
    InvalidArgument on every rank). Buffers are sized once for the worst case and reused by every call, so
    each dispatch must be followed by its combine before the next dispatch, and the calls of one AllToAll
    must run in order on the device (one stream, or streams ordered with events). Use one AllToAll per
    concurrently live layer; it lives until :meth:`destroy` or its communicator's finalize(). Calls run on
    the communicator's GPU whatever the caller's current device is, and leave the caller's current device as
    it was. Calls are asynchronous: the arrays passed to a call must stay alive and unchanged until its work
    on the stream has run (moecomm does not tell another framework's allocator about the streams it uses).


    Args:
        comm: the :class:`moecomm.Communicator`.
        max_num_tokens: most tokens a rank dispatches in one call.
        num_experts: experts in total, a multiple of the world size (rank r owns experts
            r*E/W ... (r+1)*E/W - 1).
        experts_per_token: top-k, 1..16.
        hidden_dim: values per token; a row must be a multiple of 16 bytes in ``in_dtype`` and ``out_dtype``.
        hidden_dim_scale: block scales per token (e.g. hidden_dim // 128 for FP8 blocks of 128, hidden_dim // 32
            for MXFP8; a quarter of that for scale_dtype int32), or None.
        in_dtype: dtype of dispatched tokens: bfloat16, float16, float8_e4m3fn, or uint8: opaque rows of
            hidden_dim bytes (any format, NVFP4 values with their scales say, copied as they are) (numpy/ml_dtypes
            dtype or its name).
        out_dtype: dtype of expert outputs and combined tokens: bfloat16 or float16.
        scale_dtype: float32 (the default when hidden_dim_scale is given), float8_e8m0fnu ("ue8m0": one
            power-of-two scale per byte), int32 ("ue8m0x4": four UE8M0 scales packed per int32), or None. A
            token's scales are a multiple of 4 bytes and pass through bit-exactly.
        dp_size: ranks per data-parallel group; a group's ranks hold the same tokens, share the sending
            and each receives the whole combined result.
        timeout: seconds any wait may last (default: the communicator's).
        **options: the option groups, each checked on its own and the one place its options' meanings are
            written: ``formats=`` :class:`moecomm.Formats` (the wires, the scales' layout), ``placement=``
            :class:`moecomm.Placement` (layout, capacity, overflow, replicas), ``telemetry=``
            :class:`moecomm.Telemetry` (what ``stats()`` keeps per call), ``launch=`` :class:`moecomm.Launch`
            (SMs, gradients' buffers, kernel names); each a group or a dict of its fields, or the fields as
            keywords (``capacity=32``). An unknown name, or contradictory settings, raise InvalidArgument on
            every rank. ``a2a.cfg`` (:class:`moecomm.AllToAllConfig`) holds them, checked.
    """

    def __init__(self, comm, max_num_tokens, num_experts, experts_per_token, hidden_dim,
                 hidden_dim_scale=None, in_dtype="bfloat16", out_dtype="bfloat16", scale_dtype=None,
                 dp_size=1, timeout=None, **options):
        self.comm, self._backend, self.masked, self.expert_map = comm, None, (), None
        error = None
        try:  # checked on every rank, then compared: a bad argument on one rank raises on all of them
            self.cfg = c = AllToAllConfig.create(
                comm.world_size, comm.rank, max_num_tokens, num_experts, experts_per_token, hidden_dim,
                hidden_dim_scale, in_dtype, out_dtype, scale_dtype, dp_size, **options)
            self.timeout_s = comm.timeout_s if timeout is None else timeout_seconds(timeout)[0]
            mine = (None, dict(c.key(), timeout=self.timeout_s))
        except InvalidArgument as e:
            error, mine = e, (str(e), None)
        everyone = comm.allgather(mine, "AllToAll(...)")
        _agree("AllToAll", error, mine[1], everyone, range(comm.world_size))
        transport = comm.transport
        self._context = transport.context
        with comm.calls, self._context or nullcontext(), comm.breaking():
            self._ident = comm.register(self)
            self._backend = transport.new_alltoall(c, self.timeout_s, self._ident)
            self._arrays = transport.new_arrays(c.max_num_tokens)
        if c.slots_per_rank is not None:
            from .balance import ExpertMap  # not at import: python -m moecomm.balance would find it imported
            self.expert_map = ExpertMap.static(c.num_experts, c.world_size, c.slots_per_rank)
            with comm.calls, self._context or nullcontext():
                self._backend.set_expert_map(self.expert_map)
        self._records = self._backend.records()  # {phase: its call record}: each call fills its phase's
        self._absent = None if transport.memory == "host" else 0  # an absent array in the call record
        self._in, self._out = accepted(c.in_dtype), accepted(c.out_dtype)
        self._expert = accepted(c.expert_dtype)  # out_expert_x's: the tokens as they travel
        self._scale = None if c.scale_dtype is None else accepted(c.scale_dtype)
        # expected shapes, computed once (None: any number of rows, at most max_num_tokens)
        self._token_shape, self._token_scale_shape = (None, c.hidden_dim), (None, c.hidden_dim_scale)
        self._ids_shape, self._counts_shape = (None, c.experts_per_token), (c.num_local_experts,)
        self._offsets_shape = (c.world_size + 1,) if c.layout == "ranks" else (c.num_local_experts + 1,)
        self._expert_shape, self._expert_scale_shape = c.expert_x_shape(), c.expert_x_scale_shape()
        self._slots_shape, self._ranges_shape = self._expert_shape[:-1], (c.num_local_experts, c.world_size)
        self._order = CallOrder()
        self._seen = dict.fromkeys(C.CALL_PHASES)  # {phase: _Seen of its last call, or None}
        self._captured = False          # calls keep nothing on the host (captured())
        self._serving_since = None      # comm.breaks when mask_ranks last resynchronized this AllToAll
        self._generation = 0            # restarts of the call sequence (mask_ranks), agreed by the ranks

    # ------------------------------------------------------------------------------------------
    def _live(self):
        if self._backend is None:
            raise InvalidArgument("this AllToAll was destroyed" + (" (its communicator was finalized)"
                                                                    if self.comm.transport is None else ""))
        if self.comm.broken is not None and self._serving_since != self.comm.breaks:
            self.comm.check_live()  # raises CommBroken

    def dispatch(self, out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x, dp_x_scale,
                 indices, bound_m, do_send=True, do_recv=True, weights=None, stream=None, out_expert_offsets=None,
                 tags=None, call_id=None, sources=None):
        """Send each token to the ranks of its experts and lay it out per local expert. Collective.

        Args (``m`` = tokens this call, read from ``bound_m``; each per-token array has its own number of
        rows, at least m and at most max_num_tokens, as in pplx-kernels):
            out_expert_num_tokens: [num_local_experts] int32, written: tokens received per local expert.
            out_expert_x: [num_local_experts, capacity, hidden_dim] in_dtype, float8_e4m3fn with a dispatch_wire
                (capacity: max_num_tokens *
                (world_size // dp_size) unless set), written: slots 0..count-1 of each expert hold its
                tokens (order unspecified); packed layout: [capacity, hidden_dim], expert e's tokens in
                rows out_expert_offsets[e] .. out_expert_offsets[e + 1] - 1; ranks layout: [capacity,
                hidden_dim], a row per received token (each token once), source s's tokens in token order in
                rows out_expert_offsets[s] .. out_expert_offsets[s + 1] - 1 (out_expert_num_tokens: pairs).
            out_expert_x_scale: [num_local_experts, same capacity, hidden_dim_scale] scale_dtype (columns
                first with scale_layout="column"), written like out_expert_x; None when the AllToAll has no
                scales.
            dp_x: [rows, hidden_dim] in_dtype, the tokens (identical on every rank of a DP group).
            dp_x_scale: [rows, hidden_dim_scale] scale_dtype, or None without scales or with a dispatch_wire
                (the scales are made from dp_x).
            indices: [rows, experts_per_token] int32, uint32 or int64 expert ids (read as they are), each
                in [0, num_experts) and distinct within a row, or -1 (0xffffffff as uint32): this slot
                goes nowhere (nothing is sent for it and it adds nothing in combine).
            bound_m: [1] int32 or uint32 holding m (a device array on GPUs, numpy on the host transport).
            do_send, do_recv: run the send half, the receive half, or both (the default). A send must be
                followed by a receive before the next send; other work may run between them. Both halves
                must be given the same output arrays: the send half already stores the tokens for this
                rank's own experts into them.
            weights: [rows, experts_per_token] float32 router weights, or None. When given, combine may
                be called with weights=None and then sums each token's local expert outputs on the
                expert side, sending fewer bytes back.
            out_expert_offsets: packed layout (required there): [num_local_experts + 1] int32, written:
                the first row of each local expert's tokens in out_expert_x, and the rows used at the end;
                ranks layout (required there): [world_size + 1] int32, the first row of each source rank's
                tokens, and the rows used at the end. None in the padded layout.
            tags: [rows] int32, each token's tag in [0, num_tags) (an AllToAll with num_tags), or None: the
                pairs each local expert receives are counted per tag (stats()["by_tag"]). A tag out of range
                fails the call on every rank (InvalidArgument here, PeerError on the peers).
            call_id: [1] int32 (device array on GPUs, numpy on the host), the program's number of this call
                (for example step * layers + layer), or None: every rank's must be equal, else the call
                raises OutOfStep on every rank instead of pairing calls of different steps (a rank that
                skipped or repeated a call, a ``lax.cond`` whose predicate differs between ranks), which
                counting calls alone cannot see.
            sources: a :class:`SourceLayout` of arrays the receive half also writes, as a call of
                :meth:`source_layout` right after it would (in the same launch where the launch plan's
                ``dispatch_sources`` says so: the local path of small batches), or None. Only where
                source_layout is (group_by_source=True, or world size 1), and with do_recv.
            stream: CUDA stream for device transports: an int handle, a CuPy, PyTorch or cuda.core stream,
                or None for the current stream of the framework of ``dp_x`` on the communicator's device
                (PyTorch's for a tensor, else CuPy's). Arrays from PyTorch or CuPy are taken to be written
                on that framework's current stream, DLPack producers are asked to order their stream
                before this one, and a ``__cuda_array_interface__`` stream is waited for (not while this
                stream is being captured into a CUDA graph and the producer's is not: see docs/api.md).

        Raises InvalidArgument (this rank's argument was refused: it takes part with no data and the call
        is over, no combine follows), PeerError (another rank's was), InvalidRouting (an expert id out of
        range or repeated within a row, or bound_m outside [0, the fewest rows of a per-token array], on any
        rank), CommTimeout (a peer did not answer in time; PeerExited: it left the job), OutOfStep (calls
        that do not belong together met), CommBroken (the communicator broke earlier). On GPUs the kernels
        record PeerError and InvalidRouting, which are raised once the call is over (after combine's receive
        half is issued) or by synchronize(); a dispatch raises only what was refused on this rank and
        timeouts.
        """
        self.run(_new_tuple(DispatchArgs, (out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x, dp_x_scale,
                                           indices, bound_m, weights, out_expert_offsets, tags, call_id, stream,
                                           False, False, sources)), do_send, do_recv)

    def combine(self, out_tokens, indices, weights, expert_y, bound_m, do_send=True, do_recv=True,
                stream=None, out_dropped=None, expert_weights=None, out_weights=None):
        """Send expert outputs back and form each token's router-weighted sum. Collective.

        Args (each per-token array has its own number of rows, at least m and at most max_num_tokens):
            out_tokens: [rows, hidden_dim] out_dtype, written: rows 0..m-1 get
                sum_k weights[t, k] * expert_y(expert k of token t), accumulated in float32 (zeros for a
                token whose ids are all -1); rows >= m are left as they were.
            indices: [rows, experts_per_token] int32/uint32/int64, as given to dispatch (its first m rows).
            weights: [rows, experts_per_token] float32, or None to use the weights sent with dispatch
                (summed on the expert side).
            expert_y: [num_local_experts, capacity, hidden_dim] out_dtype, laid out like out_expert_x.
            bound_m: [1] int32 or uint32 holding the same m as the dispatch (another m is refused: read
                on the device on GPUs, so reported as device errors are).
            do_send, do_recv, stream: as in :meth:`dispatch` (stream=None follows ``out_tokens``).
            out_dropped: [rows, experts_per_token] uint8, or None; rows 0..m-1 written by the receive half: 1
                where the (token, expert) pair was dropped for capacity (``overflow="drop"``) and added
                nothing, else 0.
            expert_weights, out_weights: the ranks layout only, both or neither: [capacity, experts_per_token]
                float32 (a row per received token, as :meth:`row_routing` lays them out) and [rows,
                experts_per_token] float32, written: rows 0..m-1 get the sum over ranks of the token's rows,
                in float32.

        In the ranks layout (``layout="ranks"``) expert_y is [capacity, hidden_dim], a row per received token
        (the sum of its experts' outputs, formed by the caller), weights must be None, and out_tokens[t] is the
        sum of token t's rows over the ranks that received it (unweighted; zeros where none did).

        Raises as :meth:`dispatch`, and errors the kernels recorded for this or an earlier call (GPUs;
        the message names the call). A refused combine ends its call (no retry); a combine without a
        dispatch to combine is refused.
        """
        self.run(_new_tuple(CombineArgs, (out_tokens, indices, weights, expert_y, bound_m, out_dropped, expert_weights,
                                          out_weights, stream, False, False, True)), do_send, do_recv)

    def prepare_dispatch(self, out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x, dp_x_scale, indices,
                         bound_m, weights=None, stream=None, out_expert_offsets=None, tags=None, call_id=None):
        """A :class:`PreparedCall` of :meth:`dispatch` with these arguments (as there), for a loop that gives
        the same arrays every step: its runs after the first skip reading them and check instead that each
        keeps its address, shape, dtype and layout (a changed one is refused on every rank). Nothing runs
        here. The caller keeps the arrays alive and writes their contents between runs."""
        return PreparedCall(self, DispatchArgs(out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x,
                                               dp_x_scale, indices, bound_m, weights, out_expert_offsets, tags,
                                               call_id, stream, promised=True))

    def prepare_combine(self, out_tokens, indices, weights, expert_y, bound_m, stream=None, out_dropped=None,
                        expert_weights=None, out_weights=None):
        """A :class:`PreparedCall` of :meth:`combine` with these arguments, as :meth:`prepare_dispatch`."""
        return PreparedCall(self, CombineArgs(out_tokens, indices, weights, expert_y, bound_m, out_dropped,
                                              expert_weights, out_weights, stream, promised=True))

    def run(self, args, do_send=True, do_recv=True):
        """Run the halves ``do_send`` / ``do_recv`` of the phase ``args`` describes (a :class:`DispatchArgs` or
        :class:`CombineArgs`): what :meth:`dispatch` and :meth:`combine` do, for framework layers
        (``moecomm.jax``, ``moecomm.torch``) that build the arguments themselves. Collective; raises as
        :meth:`dispatch`."""
        if self._backend is None or self.comm.broken is not None:
            self._live()
        phase, send, recv = args.phase, bool(do_send), bool(do_recv)
        calls = self.comm.calls  # one call at a time (one_call's rule, inline: the hot path of every call)
        if not calls.lock.acquire(False):
            raise calls.refused()
        previous = stream = None
        try:
            previous = self._context.enter() if self._context else None
            if self._captured:  # nothing kept on the host (captured())
                stream = self._arrays.begin(args.stream, args.first)
                self._read(args, send, recv)
                sources = self._read_sources(args, recv)
                self._arrays.order()
                return self._launch(phase, send, recv, stream, sources)  # the record _read filled
            try:
                stream = self._arrays.begin(args.stream, args.first)
                if send and phase == "dispatch" and self._order.done:  # a call left open: it ends here
                    self._end(stream, f"dispatch: call {self._order.number} was not finished on this rank (its "
                                      f"next dispatch ended it)", warn=True)
                if not (send or recv):
                    raise InvalidArgument(f"{phase}: do_send and do_recv are both False: nothing to run")
                weights, outputs = self._read(args, send, recv)
                sources = self._read_sources(args, recv)
                self._order.advance(phase, send, recv, weights, outputs)  # checks the order, then records it
            except InvalidArgument as e:
                self._refuse(e, stream)
            self._arrays.order()
            self._launch(phase, send, recv, stream, sources)
        except (CommTimeout, OutOfStep) as e:
            self._order.end()
            self.comm.fail(e)
            raise
        except (MoeCommError, InvalidArgument):  # the call is over on every rank (a refusal ended it already;
            self._order.end()                      # the backend raises what every rank raised, or at its end)
            raise
        finally:
            if previous is not None:
                self._context.leave(previous)
            calls.lock.release()

    def _launch(self, phase, send, recv, stream, sources):
        """Hand the phase's call record (filled by _read) and the dispatch's sources to the backend's launch."""
        if phase == "dispatch":
            return self._backend.dispatch(self._records[phase], send, recv, stream, sources)
        return self._backend.combine(self._records[phase], send, recv, stream)

    def _read_sources(self, args, recv):
        """A dispatch's ``sources`` (:class:`SourceLayout`) read and checked: their addresses (src_info,
        layout_range, add_counts or the record's None); None where the call has none (every combine)."""
        sources = None if args.phase == "combine" else args.sources
        if sources is None:
            return None
        if not recv:
            raise InvalidArgument("sources: the receive half writes them: give them to the call that runs it "
                                  "(do_recv=True)")
        if not isinstance(sources, SourceLayout):
            raise InvalidArgument(f"sources: a moecomm.SourceLayout, not {type(sources).__name__}")
        with torch_function_off():
            return self._source_arrays("sources", *sources)

    def _source_arrays(self, what, out_src_info, out_layout_range, add_counts):
        """The source layout's arrays read and checked (``what``: the call's name in refusals)."""
        if not self.cfg.slots_by_source:
            raise InvalidArgument(f"{what}: needs the padded layout with group_by_source=True (or world size 1): "
                                  f"elsewhere an expert's rows from one source are not consecutive")
        read = self._arrays.read
        return (read(out_src_info, "out_src_info", _COUNTS, self._slots_shape, output=True),
                read(out_layout_range, "out_layout_range", _RANGES, self._ranges_shape, output=True),
                self._absent if add_counts is None else read(add_counts, "add_counts", _COUNTS, self._counts_shape,
                                                             output=True))

    def _read(self, args, send, recv):
        """Read and check a call's arguments into its phase's call record; returns (whether router weights
        were given, the output arrays' addresses for the same-outputs rule). The hot path of every call: a
        call given the same DeviceBuffers as its phase's last one finds its record as that call left it
        (_Seen); the checks that depend on the call order run either way."""
        phase, arrays = args.phase, self._arrays
        seen = self._seen[phase]
        if seen is not None and all(map(is_, seen.arrays, args)):  # args' arrays lead its fields
            if seen.marks:  # promised arrays: refused where one changed (then read again next time)
                self._seen[phase] = None
                with torch_function_off():
                    arrays.check_marks(seen.marks, seen.producers)
                self._seen[phase] = seen
            weights, outputs = seen.weights, seen.outputs
        else:
            self._seen[phase], arrays.buffers = None, True  # read() clears buffers for any other array
            with torch_function_off():
                weights, outputs = (self._read_dispatch if phase == "dispatch" else self._read_combine)(args)
                marks = () if arrays.buffers else arrays.marks(args) if args.promised else None
            if marks is not None:
                given = tuple(getattr(args, f) for f in args.array_fields)
                self._seen[phase] = _new_tuple(_Seen, (given, weights, outputs, marks, arrays.producers()))
        if phase == "dispatch":
            if (recv and not send and not args.moved_outputs and self._order.posted("dispatch")
                    and outputs != self._order.dispatch_outputs):
                raise InvalidArgument("dispatch: the receive half got other output arrays than the send half "
                                      "(out_expert_num_tokens, out_expert_x, out_expert_x_scale must be the same)")
            return weights, outputs
        record = self._records["combine"]  # not arrays: set whether or not they were read
        record.zero_tail, record.nan_failed = args.zero_tail, args.nan_failed
        if not weights and self._order.open and not self._order.dispatch_weights and self.cfg.layout != "ranks":
            raise InvalidArgument("combine: weights=None needs the router weights to have been passed to "
                                  "dispatch(weights=...)")
        if recv and not send and self._order.posted("combine") and weights != self._order.combine_weights:
            raise InvalidArgument("combine: give weights to both halves or to neither")
        return weights, None

    def _read_dispatch(self, args):
        """Read and check a dispatch's arrays into the dispatch record; returns (whether router weights were
        given, the output arrays' addresses). An absent optional argument reads as ``self._absent`` (the
        record's None: None on the host, 0 on GPUs)."""
        c, rec, arrays, absent = self.cfg, self._records["dispatch"], self._arrays, self._absent
        read = arrays.read
        unscaled, quantised = c.hidden_dim_scale is None, c.dispatch_wire is not None
        if quantised and args.dp_x_scale is not None:
            raise InvalidArgument(f"dp_x_scale: dispatch_wire={c.dispatch_wire!r} makes the scales from dp_x: pass "
                                  f"None")
        if (args.out_expert_x_scale is None) != unscaled or (args.dp_x_scale is None) != (unscaled or quantised):
            if unscaled:
                raise InvalidArgument("this AllToAll has no scales (hidden_dim_scale=None): pass None for "
                                      "out_expert_x_scale and dp_x_scale")
            raise InvalidArgument(f"{'dp_x_scale' if args.out_expert_x_scale is not None else 'out_expert_x_scale'}:"
                                  f" required, got None")
        if (args.out_expert_offsets is None) != (c.layout == "padded"):
            raise InvalidArgument("out_expert_offsets: " + (f"required by the {c.layout} layout" if c.layout != "padded"
                                                            else "not for the padded layout, pass None"))
        rec.x = read(args.dp_x, "dp_x", self._in, self._token_shape)
        rec.indices, ids = arrays.read_as(args.indices, "indices", _INDICES, self._ids_shape)
        rec.idx64 = int(ids.itemsize == 8)
        rec.weights = absent if args.weights is None else read(args.weights, "weights", _FLOAT32, self._ids_shape)
        rec.x_scale = absent if unscaled or quantised else read(args.dp_x_scale, "dp_x_scale", self._scale,
                                                   self._token_scale_shape)
        if args.tags is not None and not c.num_tags:
            raise InvalidArgument("tags: this AllToAll counts no tags (num_tags=0): pass None")
        rec.tags = absent if args.tags is None else read(args.tags, "tags", _COUNTS, _TAGS)
        rec.rows = arrays.rows  # the fewest rows of the per-token arrays
        rec.bound_m = read(args.bound_m, "bound_m", _BOUND_M, _ONE)
        rec.call_id = absent if args.call_id is None else read(args.call_id, "call_id", _COUNTS, _ONE)
        rec.out_num = read(args.out_expert_num_tokens, "out_expert_num_tokens", _COUNTS, self._counts_shape, True)
        rec.out_x = read(args.out_expert_x, "out_expert_x", self._expert, self._expert_shape, True)
        rec.out_scale = absent if unscaled else read(args.out_expert_x_scale, "out_expert_x_scale", self._scale,
                                                     self._expert_scale_shape, True)
        rec.out_offsets = absent if args.out_expert_offsets is None else read(
            args.out_expert_offsets, "out_expert_offsets", _COUNTS, self._offsets_shape, True)
        address = arrays.address
        return args.weights is not None, (address(rec.out_num), address(rec.out_x),
                                          None if unscaled else address(rec.out_scale))

    def _read_combine(self, args):
        """Read and check a combine's arrays into the combine record; returns (whether router weights were
        given, None), as :meth:`_read_dispatch`."""
        rec, arrays, absent = self._records["combine"], self._arrays, self._absent
        read = arrays.read
        rec.out_tokens = read(args.out_tokens, "out_tokens", self._out, self._token_shape, True)
        rec.indices, ids = arrays.read_as(args.indices, "indices", _INDICES, self._ids_shape)
        rec.idx64 = int(ids.itemsize == 8)
        rec.weights = absent if args.weights is None else read(args.weights, "weights", _FLOAT32, self._ids_shape)
        rec.out_dropped = absent if args.out_dropped is None else read(args.out_dropped, "out_dropped", _FLAGS,
                                                                       self._ids_shape, True)
        if self.cfg.layout == "ranks" or args.expert_weights is not None or args.out_weights is not None:
            self._read_side_rows(args, rec)
        rec.rows = arrays.rows  # the fewest rows of the per-token arrays
        rec.partials = int(args.weights is None)
        rec.y = read(args.expert_y, "expert_y", self._out, self._expert_shape)
        rec.bound_m = read(args.bound_m, "bound_m", _BOUND_M, _ONE)
        return args.weights is not None, None

    def _read_side_rows(self, args, rec):
        """The ranks layout's combine: weights None; expert_weights and out_weights, both or neither."""
        c, read = self.cfg, self._arrays.read
        if c.layout != "ranks":
            raise InvalidArgument("expert_weights: only in the ranks layout (layout='ranks'), pass None (and "
                                  "out_weights)")
        if args.weights is not None:
            raise InvalidArgument("weights: the ranks layout sums each token's rows unweighted (expert_y holds the "
                                  "weighted sum of a row's experts): pass None")
        if (args.expert_weights is None) != (args.out_weights is None):
            raise InvalidArgument(f"{'out_weights' if args.out_weights is None else 'expert_weights'}: give both "
                                  f"expert_weights and out_weights, or neither")
        if args.out_dropped is not None:
            raise InvalidArgument("out_dropped: the ranks layout drops nothing (no capacity): pass None")
        expert_w = out_w = self._absent
        if args.expert_weights is not None:
            expert_w = read(args.expert_weights, "expert_weights", _FLOAT32, (c.expert_capacity, c.experts_per_token))
            out_w = read(args.out_weights, "out_weights", _FLOAT32, self._ids_shape, True)
        if self.comm.transport.memory == "device":  # in the fields the ranks layout leaves free (_abi.CALL_FIELDS)
            rec.weights, rec.out_dropped = expert_w, out_w
        else:
            rec.expert_w, rec.out_w = expert_w, out_w

    def _refuse(self, error, stream):
        """Raise ``error``, a refused argument or call order, after ending the call it belongs to on this rank:
        the call in progress (its remaining halves), or the next call (all four halves) when none is. Those
        halves are issued with no data, flagged with the refusal, so that every peer raises PeerError for
        the same call and the ranks' calls stay paired (the refusal's call is over; the next dispatch starts
        the next call)."""
        if stream is None and self._context is not None:  # the stream was refused: take part on the current one
            stream = self._arrays.begin(None, None)
        code = C.ERR_REFUSED | _argument_of(error) << C.REASON_ARG_SHIFT
        halves = self._order.remaining() or HALVES
        self._backend.skip(halves, stream, Refusal(str(error), code))
        self._order.skipped(halves)
        raise error

    def _end(self, stream, text, warn=False):
        """End the call in progress on this rank: its remaining halves are issued with no data, flagged
        ERR_ENDED (the peers raise PeerError for it, unless their halves with it are over); ``warn``: say so
        (a dispatch found the call open: abort() is the way to end one on purpose)."""
        halves = self._order.remaining()
        if warn:
            warnings.warn(text + "; the peers raise PeerError for that call (a2a.abort() ends a call on purpose)",
                          RuntimeWarning, stacklevel=4)
        self._backend.skip(halves, stream, Refusal(text, C.ERR_ENDED))
        self._order.skipped(halves)

    @one_call
    def abort(self, stream=None):
        """End the call in progress on this rank, for a failure between its halves (the application's own,
        say): its remaining halves are issued with no data, so that every peer raises PeerError for this
        call (not a later one) and the next dispatch starts the next call on every rank. Calling the next
        dispatch without it does the same, with a warning. Nothing to do between calls. Not collective (the
        peers learn of it in the call); on GPUs ordered on ``stream`` (None: CuPy's current stream) after the
        call's halves so far. Once this rank's combine send half has run, its peers have their data: only
        its own receive half is dropped."""
        self._live()
        if not self._order.done:
            return
        with self._context or nullcontext(), self.comm.breaking():
            s = None if self._context is None else self._arrays.begin(stream, None)
            try:
                self._end(s, f"call {self._order.number} aborted by the application on rank {self.cfg.rank}")
            except (CommTimeout, OutOfStep):
                self._order.end()
                raise

    @one_call
    def synchronize(self, stream=None):
        """Wait for this AllToAll's work on ``stream`` and raise any error its kernels recorded
        (CommTimeout naming the peer, InvalidRouting, ...). Dispatch and combine never synchronize; errors
        of earlier calls are also raised at the start of the next call. Not collective.

        An error of the call in progress (a dispatch whose combine has not run, say) ends that call: its
        remaining halves are issued with no data, flagged so that the peers raise too (they raise the same
        error where their kernels recorded it, else PeerError), and the next dispatch starts a new call."""
        self._live()
        with self._context or nullcontext(), self.comm.breaking():
            s = None if self._context is None else self._arrays.begin(stream, None)
            try:
                self._backend.synchronize(s)
            except CommTimeout:
                raise
            except MoeCommError as e:
                if self._order.open and getattr(e, "call", None) == self._order.number:
                    self._end(s, str(e))
                raise

    def check(self):
        """Raise the error the kernels recorded that no call has raised yet (CommTimeout naming the peer,
        PeerError, InvalidRouting, ...), without synchronizing: it covers the calls the GPU has finished. For
        calls the host does not see, replayed from a CUDA graph (:meth:`captured`; ``moecomm.jax`` in a jitted
        step): call it once the step's outputs are ready. Every rank's kernels record an error of a call that
        failed on any rank. Not collective; nothing to do on the host transport, which raises in the call."""
        self._live()
        with self.comm.breaking():
            self._backend.check_error()

    @contextmanager
    def captured(self, recording=True):
        """Within it, calls (dispatch, combine, plan and the backward calls) keep nothing on the host, for a
        framework that may record them into a CUDA graph and replay it without the host (XLA's command
        buffers: ``moecomm.jax``): their arguments are read and checked and their kernels launched, but the
        call order is not kept on the host: the kernels keep it (each half counts its calls, and the ranks'
        kernels pair by those counts), check what depends on the data there (m, the expert ids, the ranks'
        agreement, capacity) and record errors, which :meth:`check` raises. ``recording``: the launches go
        into a graph being recorded, so no recorded error is raised by them either (else a call raises the
        errors recorded so far, as outside). The framework orders the calls (dispatch before its combine).
        GPU transports only."""
        if self.comm.transport.memory != "device":
            raise InvalidArgument("captured(): CUDA graphs need a GPU transport")
        self._captured, self._backend.captured = True, bool(recording)
        try:
            yield self
        finally:
            self._captured = self._backend.captured = False

    # gradients --------------------------------------------------------------------------------
    @property
    def gradients(self):
        """Whether this AllToAll computes gradients (plan, dispatch_backward, combine_backward): on the host
        transport always, on GPU transports when constructed with ``gradients=True``. Framework layers ask
        before a forward that keeps a plan."""
        return self._backend is not None and self._backend.gradients

    def plan_shapes(self):
        """The shapes of a :class:`RoutingPlan` of this AllToAll (its arrays are int32)."""
        c = self.cfg
        slots = tuple(c.expert_x_shape()[:-1])
        pairs = (c.max_num_tokens, c.experts_per_token)
        return RoutingPlan(pairs, slots + (3,), (2,), (1 + int(np.prod(slots)),), pairs)

    @one_call
    def plan(self, out_plan, stream=None):
        """Write the placement of the last dispatch into ``out_plan`` (a :class:`RoutingPlan` of int32 arrays
        shaped as :meth:`plan_shapes` says): call it between the dispatch's receive half and its combine (from
        the combine on, a peer's next dispatch may reuse what it reads; on GPUs it is ordered on ``stream`` after
        that receive half; default the current stream of out_plan.expert's framework). Not collective; the plan
        stays valid after other calls (it is data)."""
        self._gradients()
        with self._context or nullcontext():
            s = self._arrays.begin(stream, out_plan.expert if isinstance(out_plan, RoutingPlan) else None)
            rp = self._read_plan(out_plan, output=True)
            self._arrays.order()
            self._backend.write_plan(rp, s)

    @one_call
    def source_layout(self, out_src_info, out_layout_range, stream=None, add_counts=None):
        """Where the last dispatch put each source rank's rows, as DeepEP's low-latency handle describes them
        (its ``src_info`` and ``layout_range``): in the padded layout whose experts' slots are grouped by source
        rank (``group_by_source=True``, or world size 1). Not collective; call it between the dispatch's receive
        half and its combine, as :meth:`plan` (on GPUs: one small kernel, ordered on ``stream`` after that receive
        half; default the current stream of out_src_info's framework). Needs no ``gradients``. The arrays, their
        shapes and dtypes: :class:`SourceLayout`'s fields (``add_counts`` added to in the same launch). A
        dispatch given them as its ``sources`` writes them itself (one call, and no launch of its own on the
        local path of small batches).
        """
        self._live()
        with self._context or nullcontext():
            s = self._arrays.begin(stream, out_src_info)
            sources = self._source_arrays("source_layout", out_src_info, out_layout_range, add_counts)
            self._arrays.order()
            self._backend.write_sources(*sources, s)

    @one_call
    def row_routing(self, out_indices, out_weights=None, stream=None):
        """The ranks layout's routing of each received row (DeepEP's ``recv_topk_idx`` and ``recv_topk_weights``)
        of the last dispatch. Not collective; call it between the dispatch's receive half and its combine, as
        :meth:`source_layout`.

        Args:
            out_indices: [capacity, experts_per_token] int32 or int64, written: row j's (its token's) expert ids
                as this rank's local experts, -1 where the expert is another rank's or the id was -1; rows past
                the last received (out_expert_offsets[world_size]) all -1.
            out_weights: [capacity, experts_per_token] float32, or None, written: the weights dispatched with
                the token where out_indices is a local expert, else 0 (zeros without weights at dispatch).
        """
        self._live()
        c = self.cfg
        if c.layout != "ranks":
            raise InvalidArgument("row_routing: the ranks layout's (layout='ranks'); the padded and packed layouts "
                                  "hold a row per (token, expert) pair")
        rows = (c.expert_capacity, c.experts_per_token)
        with self._context or nullcontext():
            s = self._arrays.begin(stream, out_indices)
            indices, ids = self._arrays.read_as(out_indices, "out_indices", _INDICES, rows, output=True)
            weights = None if out_weights is None else self._arrays.read(out_weights, "out_weights", _FLOAT32, rows,
                                                                         output=True)
            self._arrays.order()
            self._backend.write_row_routing(indices, int(ids.itemsize == 8), weights, s)

    def dispatch_backward(self, out_grad_x, plan, grad_expert_x, bound_m, stream=None):
        """The backward of a dispatch: each token's gradient is the sum of the gradients of the slots the
        dispatch put it in (over its experts; nothing from -1 ids or dropped pairs). Collective; it needs no
        call order (the plan says everything) and may run between any calls.

        Args:
            out_grad_x: [rows, hidden_dim] bfloat16, float16 or float32, written: rows 0..m-1 (accumulated in
                float32), on every rank of the token's DP group; rows >= m are left as they were. With an
                FP8 dispatch this is the gradient of the unquantised tokens (straight-through).
            plan: the :class:`RoutingPlan` of that dispatch (:meth:`plan`), the same call on every rank.
            grad_expert_x: out_expert_x's shape, bfloat16, float16 or float32: the gradient of each slot
                (each travels in its own dtype).
            bound_m: [1] int32 holding that dispatch's m.
            stream: as in :meth:`dispatch` (GPUs; None follows out_grad_x).

        Raises InvalidArgument for a refused argument (the peers raise PeerError naming this rank), and as
        :meth:`dispatch` for timeouts. On GPUs the kernels check m and the plans (every rank's must be of
        the same dispatch), and what they record is raised at the end of this call or a later one, or by
        :meth:`synchronize`, as for dispatch. A call that raises leaves its outputs unspecified (it may have
        written part of them); the next call is unaffected.
        """
        self._backward("dispatch_backward", stream, out_grad_x, lambda: self._read_backward(
            plan, bound_m, (grad_expert_x, "grad_expert_x", self._expert_shape),
            out=(out_grad_x, "out_grad_x", self._token_shape)))

    def combine_backward(self, out_grad_expert_y, out_grad_weights, plan, grad_out, weights, expert_y, bound_m,
                         stream=None):
        """The backward of a combine: ``grad_expert_y[slot of (t, k)] = weights[t, k] * grad_out[t]`` and
        ``grad_weights[t, k] = <grad_out[t], expert_y[slot of (t, k)]>`` (reduced where the rows are and
        sent back as one number per pair). The same for weights given at combine and weights sent with
        dispatch. Collective; needs no call order.

        Args:
            out_grad_expert_y: expert_y's shape, bfloat16, float16 or float32, written: each slot that holds
                a pair gets its gradient; empty slots are left as they were, as out_expert_x's are by dispatch
                (pass zeros where the experts' backward reads every slot: a dense gradient of their weights).
            out_grad_weights: [rows, experts_per_token] float32, written: rows 0..m-1 (0 for -1 ids and pairs
                without a slot), on every rank of the token's DP group.
            plan: the :class:`RoutingPlan` of the combined dispatch, the same call on every rank.
            grad_out: [rows, hidden_dim] bfloat16, float16 or float32, the gradient of combine's out_tokens
                (rows 0..m-1 are read; they travel in this dtype).
            weights: [rows, experts_per_token] float32, the router weights of the forward (given to combine,
                or sent with dispatch).
            expert_y: the expert outputs the forward combined ([num_local_experts, capacity, hidden_dim]
                out_dtype).
            bound_m: [1] int32 holding the forward's m.
            stream: as in :meth:`dispatch` (GPUs; None follows out_grad_expert_y).

        Raises as :meth:`dispatch_backward`.
        """
        self._backward("combine_backward", stream, out_grad_expert_y, lambda: self._read_backward(
            plan, bound_m, (grad_out, "grad_out", self._token_shape),
            out_grad_y=(out_grad_expert_y, "out_grad_expert_y", self._expert_shape),
            out_grad_weights=(out_grad_weights, "out_grad_weights", self._ids_shape, _FLOAT32),
            weights=(weights, "weights", self._ids_shape, _FLOAT32),
            y=(expert_y, "expert_y", self._expert_shape, self._out)))

    @one_call
    def _backward(self, phase, stream, first, read):
        """Run backward ``phase`` on ``stream`` (None: the current stream of ``first``'s framework) on the
        arguments ``read()`` returns; a refused argument takes part with no data first, so that the peers
        raise PeerError naming this rank."""
        self._gradients()
        with self._context or nullcontext():
            s = None
            try:
                s = self._arrays.begin(stream, first)
                args = read()
            except InvalidArgument as e:
                if s is None and self._context is not None:  # a stream refused: take part on the current one
                    s = self._arrays.begin(None, None)
                code = C.ERR_REFUSED | _argument_of(e) << C.REASON_ARG_SHIFT
                with self.comm.breaking():
                    self._backend.skip_backward(phase, Refusal(str(e), code), s)
                raise
            self._arrays.order()
            try:
                getattr(self._backend, phase)(args, s)
            except (CommTimeout, OutOfStep) as e:
                self.comm.fail(e)
                raise

    def _gradients(self):
        """Raise unless this AllToAll is live and computes gradients along routing plans."""
        self._live()
        if not self._backend.gradients:
            raise InvalidArgument(no_gradients(self.comm.transport.name))
        if self.cfg.layout == "ranks":
            raise InvalidArgument("plan: the ranks layout has none; a dispatch's backward is a combine along its "
                                  "routing and a combine's a dispatch of the gradients along it (as DeepEP's normal "
                                  "mode trains: moecomm.compat.deep_ep)")

    def _read_plan(self, plan, output=False):
        """``plan`` (a RoutingPlan) read as a RoutingPlan of values."""
        if not isinstance(plan, RoutingPlan):
            raise InvalidArgument(f"plan: expected a moecomm.RoutingPlan, got {type(plan).__name__}")
        shapes, read = self.plan_shapes(), self._arrays.read
        return RoutingPlan(**{field: read(getattr(plan, field), f"plan.{field}", _COUNTS, getattr(shapes, field),
                                          output) for field in RoutingPlan._fields})

    def _read_backward(self, plan, bound_m, grad, **named):
        """A backward call's arguments: the plan, m, the gradient ``grad`` and ``named`` others, each
        (array, name, shape[, accepted dtypes: float gradients by default]). On the host transport m is
        checked here against the rows and the plan; on GPUs the kernels check it."""
        rp, arrays = self._read_plan(plan), self._arrays
        m_value = arrays.read(bound_m, "bound_m", _BOUND_M, _ONE)
        values, dtypes, per_token = {}, {}, []
        for field, (array, name, shape, *kinds) in dict(named, grad=grad).items():
            values[field], dtypes[field] = arrays.read_as(array, name, kinds[0] if kinds else _GRAD, shape,
                                                          output=field.startswith("out"))
            if shape[0] is None:
                per_token.append(name)
        m = None
        if isinstance(m_value, np.ndarray):  # the host transport: checked here
            m = int(m_value[0])
            if not m_in_range(m, arrays.rows, self.cfg.max_num_tokens):
                raise InvalidArgument(f"bound_m: m={m} must be in [0, the fewest rows of {', '.join(per_token)}]")
            if (rp.expert[m:] >= 0).any():
                raise InvalidArgument(f"plan: it has pairs for tokens >= m={m}: it is another call's plan")
        written = dtypes.get("out", dtypes.get("out_grad_y"))
        return _Backward(m=m, bound_m=m_value, rows=arrays.rows, **rp._asdict(), grad_dtype=dtypes["grad"],
                         out_dtype=written, **values)

    @one_call
    def mask_ranks(self, ranks):
        """Stop exchanging with ``ranks`` (a dead rank, say), or with no rank (``[]``: unmask all). Collective
        among the ranks not in ``ranks``, bounded by the timeout; every one of them must pass the same set.

        From the next call on, tokens routed to experts of masked ranks are not sent and add nothing in
        combine (as if their ids were -1), and no wait involves a masked rank; the pairs not sent are counted
        in :meth:`stats` ("MASKED_PAIRS"). With an expert map, a pair goes to its expert's next replica on a
        rank not masked where there is one (moecomm.balance.ExpertMap.physical). The ranks taking part first
        finish their work in flight (their kernels are bounded), then restart this AllToAll's call sequence
        together, so this is also how the survivors recover after a CommTimeout naming a dead rank: this
        AllToAll serves again although the communicator stays broken. Afterwards the communicator's own
        collectives (barrier, allgather, check_peers, new AllToAlls) raise CommBroken, since they would wait for
        every rank, and teardown is local; every AllToAll masked since the communicator last broke serves (mask
        each one you keep). Unmasking a rank that comes back takes that rank's part too. Needs dp_size == 1 and
        no call in progress.

        Args:
            ranks: iterable of ranks to mask (not this rank).
        """
        if self._backend is None:
            raise InvalidArgument("this AllToAll was destroyed")
        W = self.cfg.world_size
        error = None
        try:
            masked = tuple(sorted({int(q) for q in ranks}))
            if any(not 0 <= q < W for q in masked) or self.cfg.rank in masked:
                raise InvalidArgument(f"mask_ranks: ranks must be in [0, {W}) and not this rank "
                                      f"({self.cfg.rank}), got {list(masked)}")
            if self.cfg.dp_size != 1:
                raise InvalidArgument(f"mask_ranks: needs dp_size == 1, this AllToAll has {self.cfg.dp_size}")
            if self._order.open:
                raise InvalidArgument("mask_ranks: a call is in progress (a dispatch without its combine, or a "
                                      "send half without its receive half)")
        except (TypeError, ValueError) as e:
            error, masked = (e if isinstance(e, InvalidArgument) else
                             InvalidArgument(f"mask_ranks: expected an iterable of ranks, got {ranks!r}")), None
        taking_part = [q for q in range(W) if masked is None or q not in masked]
        wants = self.comm.gather_among((str(error) if error else None, masked, self._generation), taking_part,
                                       f"mask_ranks of AllToAll #{self._ident}")
        _agree("mask_ranks", error, masked, [(reason, theirs) for reason, theirs, _ in wants], taking_part)
        generation = max(g for _, _, g in wants) + 1  # a rank back from the dead may have missed some
        with self._context or nullcontext(), self.comm.breaking():
            self._backend.set_mask(masked, generation, lambda: self.comm.gather_among(None, taking_part, "mask_ranks"))
        self.masked, self._generation = masked, generation
        self._order.restart()
        if self.comm.broken is None:  # a new break would stop the other AllToAlls masked since the last one
            self.comm.fail(MoeCommError(f"mask_ranks({list(masked)}) on AllToAll #{self._ident}: the communicator "
                                        f"serves only through masked AllToAlls"))
        self._serving_since = self.comm.breaks  # this AllToAll serves until the communicator breaks again

    @one_call
    def set_expert_map(self, expert_map):
        """Switch to another :class:`moecomm.balance.ExpertMap` (collective: every rank passes an equal map,
        checked, bounded by the timeout). It takes effect at the next dispatch on every rank together; no
        buffer is reallocated (they are sized for slots_per_rank). Every call carries the map's generation,
        and a call whose ranks carry different generations raises ExpertMapMismatch on every rank instead of
        routing. The map's generation must differ from the current one. Moving expert weights into their
        new slots is the caller's: the switch is safe once every rank has finished the previous combine
        (which this call requires) and holds the new weights before its next dispatch."""
        self._live()
        if self.expert_map is None:
            raise InvalidArgument("set_expert_map: this AllToAll has no expert slots (construct it with "
                                  "slots_per_rank=...)")
        c, error = self.cfg, None
        try:
            from .balance import ExpertMap
            if not isinstance(expert_map, ExpertMap):
                raise InvalidArgument(f"set_expert_map: expected a moecomm.balance.ExpertMap, got "
                                      f"{type(expert_map).__name__}")
            if (expert_map.num_experts, expert_map.slots.shape) != (c.num_experts, (c.world_size, c.slots_per_rank)):
                raise InvalidArgument(f"set_expert_map: a map of {expert_map.num_experts} experts on "
                                      f"{expert_map.slots.shape} slots; this AllToAll has {c.num_experts} experts on "
                                      f"{(c.world_size, c.slots_per_rank)}")
            if expert_map.generation == self.expert_map.generation:
                raise InvalidArgument(f"set_expert_map: generation {expert_map.generation} is the current map's; "
                                      f"give the new map another")
            if self._order.open:
                raise InvalidArgument("set_expert_map: a call is in progress (a dispatch without its combine)")
            mine = (None, f"map generation {expert_map.generation}, slots digest "
                          f"{hashlib.sha256(expert_map.slots.tobytes()).hexdigest()[:16]}")
        except InvalidArgument as e:
            error, mine = e, (str(e), None)
        everyone = self.comm.allgather(mine, f"set_expert_map of AllToAll #{self._ident}")
        _agree("set_expert_map", error, mine[1], everyone, range(self.comm.world_size))
        self.expert_map = expert_map
        with self._context or nullcontext():
            self._backend.set_expert_map(expert_map)

    def stats(self):
        """This rank's telemetry since the AllToAll was created, kept by the kernels in device memory and
        copied here (this call waits for the rank's work on its GPU: the one synchronizing call). Not
        collective; gather it from every rank for the whole picture (:func:`moecomm.telemetry.from_stats`).

        Returns a dict (L = num_local_experts, W = world size):
            MASKED_PAIRS: (token, expert) pairs this rank did not send because the expert's rank was masked.
            DROPPED_PAIRS: pairs routed to this rank's experts past their capacity (overflow="drop").
            OVERFLOW_PAIRS: the same under overflow="error" (in the calls that raised CapacityExceeded).
            CALLS: dispatches this rank received with data.
            received: [L] int64 tokens received per local expert (slot), dropped: [L] pairs dropped per one.
            window: [min(CALLS, telemetry_window), L] int64 pairs routed to each local expert (its demand,
                dropped pairs included) in each of the last calls, oldest first.
            bytes: {"dispatch_sent", "dispatch_received", "combine_sent", "combine_received": [W] int64}
                bytes exchanged with each peer (0 for this rank).
            times_us: {"dispatch", "combine": [microseconds per call]} with timing=True, else None.
            plan: GPU transports: what the AllToAll launches ({"variant": the kernels' module, "sm_budget",
                "grids": {kernel: blocks}, "halves": {half: kernels}, "whole": {phase: kernels} where both
                halves are requested together, "fallback": {phase: why it runs its halves' kernels} where
                its one-launch grid is not resident, "streamed", "combine_streams"}); None on the host.
            rank: this rank; generation: the expert map's generation (None without slots_per_rank).
        """
        self._live()
        with self._context or nullcontext():
            out = self._backend.snapshot()
        out.update(rank=self.cfg.rank, generation=None if self.expert_map is None else self.expert_map.generation)
        return out

    @one_call
    def destroy(self):
        """End a call in progress as :meth:`abort` does, then release the buffers (collective; local only when
        the communicator is broken or ranks are masked). Safe to call twice; later calls raise InvalidArgument."""
        if self._backend is not None:
            if self._order.done and self.comm.broken is None:  # a call in progress: ended first, so that the
                with suppress(MoeCommError):                    # peers' halves of it pair with this rank's
                    self.abort()
            backend, self._backend = self._backend, None
            with self._context or nullcontext(), self.comm.breaking():
                backend.destroy(collective=self.comm.broken is None and not self.masked)
                self._arrays.close()
            self.comm.unregister(self)


    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()


def no_gradients(transport):
    """The message of a gradient asked of an AllToAll on ``transport`` that does not compute them."""
    return (f"gradients (plan, dispatch_backward, combine_backward): this AllToAll on the {transport} transport "
            f"was constructed without them: pass gradients=True to moecomm.AllToAll(...)")


def _argument_of(error):
    """The number in ARGUMENTS of the argument an InvalidArgument names ("name: ..."); 0 when it names none
    (the order of calls)."""
    name = str(error).split(":", 1)[0]
    return ARGUMENTS.index(name) if name in ARGUMENTS else 0


def _agree(what, error, value, gathered, ranks):
    """The end of a collective check: ``gathered`` holds every taking-part rank's (its refusal's text or
    None, its value), in the order of ``ranks``. Raise this rank's own ``error``, else InvalidArgument
    naming the first rank that refused or whose value differs from this rank's ``value`` (for a dict, the
    fields that differ): every rank raises."""
    if error is not None:
        raise error
    for q, (reason, _) in zip(ranks, gathered):
        if reason:
            raise InvalidArgument(f"{what}: rank {q} refused its arguments: {reason}")
    for q, (_, theirs) in zip(ranks, gathered):
        if theirs != value:
            if isinstance(value, dict):
                fields = [k for k in value if theirs.get(k) != value[k]]
                theirs = ", ".join(f"{k}={theirs.get(k)!r}" for k in fields)
                value = ", ".join(f"{k}={value[k]!r}" for k in fields)
            raise InvalidArgument(f"{what}: rank {q} has {theirs}; this rank {value}: every rank taking part "
                                  f"must pass the same")
