"""AllToAll on GPUs, for every GPU transport: the kernels of ``cuda/`` over symmetric buffers sized once
(``transport.symmetric``), launched through ``transport.launch`` as the AllToAll's launch plan says
(moecomm/transport/gpu_plan.py: which kernel each half runs, with what grid, from which module).

Symmetric memory per rank (bytes), W ranks, M = max_num_tokens, K = top-k, H = hidden_dim:

    dispatch records   W * M * R          R = align16(H * in_size) + align16(scale bytes) + align16(4 + 8K)
    combine rows       max(W, K) * M * B      B = H * out_size, or on an FP8 combine wire align16(H + scale bytes)
    staging            blocks * 4 * max(R, H * out_size)   (sources of puts to non-mapped peers)
    signals            4 * W * 8          (dispatch, combine, the detail of a failed call, the call ids)
    arrival words      2 * W * M * 8      (one per dispatch record slot, one per partial sum of combine)
    drop words         W * M * 8          (only with overflow="drop")
    gradient rows      W * M * G          G = 4H + align16(4K) + 16 (only with gradients=True; backward.cu)
    gradient words     (3 * W + M * K) * 8   (signals, "read" words, router weights' gradients; same)

(:func:`symmetric_bytes`). Bytes on the wire per call, for n tokens sent by a rank and reaching on
average r distinct other ranks: dispatch n * r * R (a token's rows for this rank's own experts are
stored in place by the send kernel, with no record); combine n * r * B with router weights at dispatch (one
partial per token and expert rank), else n * K * B (B: moecomm._abi.combine_row_bytes).

No host synchronization happens in dispatch or combine: m is read on the device from ``bound_m``, epochs
and counters live in device memory, errors land in a mapped host word. Every rank runs every phase of
every call on the device, so the ranks' kernels always pair up: a rank whose call was refused runs the
rest of the call with no data (``Call.skip``) and flags its signals with the reason, which the peers'
kernels record. Errors the kernels record are raised after the call's combine receive half has been
issued (the call is over on every rank, so raising skips nothing) and by :meth:`synchronize`; a timeout
is raised at the start of any call (the communicator is then broken). Each kernel's parameter block
(:class:`moecomm._abi.Fixed` and the call record :class:`moecomm._abi.Call`) is built once; a call writes
the call record and launches.
"""
import numpy as np

from .. import _abi, _cuda
from .. import _constants as C
from .._dtypes import bfloat16, float16
from .._errors import InvalidArgument
from .base import AllToAllBackend, snapshot
from .gpu_plan import ROW_ROUTING, SOURCE_LAYOUT, launch_plan, pack, phase_of


def record_bytes(cfg):
    """Bytes of one dispatch record (moecomm._abi.RecordLayout): token row, scales, token index + expert ids +
    weights."""
    return _abi.RecordLayout.of(cfg).size


def _quant_code(cfg):
    """Fixed.quant of ``cfg``: how the send side quantises (dispatch_wire, and the scales' format)."""
    if cfg.dispatch_wire is None:
        return C.QUANT_NONE
    if cfg.dispatch_wire == "e4m3":
        return C.QUANT_FLOAT
    return C.QUANT_POW2 if np.dtype(cfg.scale_dtype) == np.float32 else C.QUANT_UE8M0


def symmetric_sizes(cfg, plan):
    """Bytes of each symmetric buffer one rank allocates for ``cfg`` launched by ``plan`` (a LaunchPlan; the
    formula in the module doc), and the staging row size: {"recv_buf", "comb_buf", "stage", "signals",
    "arrive", "drop_buf", "grad_buf", "grad_words", "stage_row"}."""
    W, M, K = cfg.world_size, cfg.max_num_tokens, cfg.experts_per_token
    comb_row = _abi.combine_row_bytes(cfg)
    grad_row = _abi.grad_row_bytes(cfg) if cfg.gradients else 0
    stage_row = max(record_bytes(cfg), comb_row, grad_row)
    return dict(recv_buf=W * M * record_bytes(cfg), comb_buf=max(W, K) * M * comb_row,
                stage=plan.stage_rows * stage_row, signals=4 * W * 8, arrive=2 * W * M * 8, stage_row=stage_row,
                drop_buf=W * M * 8 if cfg.drops else 0,
                grad_buf=W * M * grad_row, grad_words=(3 * W + M * K) * 8 if cfg.gradients else 0)


def symmetric_bytes(cfg, num_sms=132):
    """Symmetric memory one rank allocates for this configuration (132 SMs: an H100/H200)."""
    sizes = symmetric_sizes(cfg, launch_plan(cfg, num_sms, "ipc"))
    return sum(v for k, v in sizes.items() if k != "stage_row")


# MOECOMM_DT_* of the dtypes the kernels convert (expert outputs, gradients)
_DT_CODES = {np.dtype(bfloat16): C.DT_BF16, np.dtype(float16): C.DT_FP16, np.dtype(np.float32): C.DT_FP32}


def _pointers(**arrays):
    """{name: device address} of CuPy arrays, 0 for None."""
    return {k: 0 if a is None else a.data.ptr for k, a in arrays.items()}


class GpuAllToAll(AllToAllBackend):
    """Created and used inside the transport's context (moecomm.AllToAll enters it)."""

    def __init__(self, transport, cfg, timeout_s):
        import cupy
        self.t, self.cfg, self._cupy = transport, cfg, cupy
        # which kernels run, with what grids, from which module: decided there, executed here
        self.plan = plan = launch_plan(cfg, transport.num_sms, transport.variant, transport.all_mapped)
        self.module = transport.module_of(plan.variant)
        W, M, K, L = cfg.world_size, cfg.max_num_tokens, cfg.experts_per_token, cfg.num_local_experts
        window = cfg.telemetry_window
        rec, counters = _abi.RecordLayout.of(cfg), _abi.counter_layout(cfg)
        state = _abi.state_layout(cfg, plan.grids.get("moecomm_combine_local", 0))
        sizes = symmetric_sizes(cfg, plan)
        self.state = cupy.zeros(state.size, np.uint32)
        self.slot_of = cupy.empty(W * M * K, np.int32)
        self.own_of = cupy.empty(M * K * 2, np.int32)
        self.ids_of = cupy.empty(M * K, np.int32)
        self.mask = cupy.zeros(W, np.int32)
        self.counters = cupy.zeros(counters.size, np.uint64)
        self.ring = cupy.zeros((window, L), np.uint32)
        # tags and router confidence: rows for the window and the next call's (cuda/alltoall.cuh, call_row)
        self.window, self.tally_rows = window, 1 << window.bit_length()
        R = self.tally_rows
        self.tag_ring = cupy.zeros((R, cfg.num_tags, L), np.uint32) if cfg.num_tags and window else None
        self.gap_ring = cupy.zeros((R, C.GAP_BINS), np.uint32) if cfg.score_gap and window else None
        self.map = None if cfg.slots_per_rank is None else cupy.zeros((cfg.num_experts, 1 + W), np.int32)
        self._generation = 0
        sym = transport.symmetric
        self.recv_buf = sym((sizes["recv_buf"],), np.uint8)
        self.comb_buf = sym((sizes["comb_buf"],), np.uint8)
        self.stage = sym((sizes["stage"],), np.uint8)
        self.sig = sym((4, W), np.uint64)  # [0]: dispatch signals, [1]: combine signals, [2]: why, [3]: call ids
        self.arrive = sym((2, W, M), np.uint64)  # arrival words (the call) of [0] dispatch records, [1] partial sums
        self._owned = [self.recv_buf, self.comb_buf, self.stage, self.sig, self.arrive]
        self.drop_buf = sym((W, M), np.uint64) if cfg.drops else None
        if cfg.drops:
            self._owned.append(self.drop_buf)
            self.drop_buf.fill(0)
        self.sig.fill(0)
        self.arrive.fill(0)
        self.sent = self.grad_buf = self.grad_sig = self.grad_w = None
        if cfg.gradients:  # backward.cu
            self.sent = cupy.empty(M * K, np.int32)
            self.grad_buf = sym((sizes["grad_buf"],), np.uint8)
            self.grad_sig = sym((3, W), np.uint64)  # [0]: rows, [1]: router weights' gradients, [2]: "read" words
            self.grad_w = sym((M * K,), np.uint64)
            self._owned += [self.grad_buf, self.grad_sig, self.grad_w]
            for a in (self.grad_buf, self.grad_sig, self.grad_w):
                a.fill(0)
        self._dispatched = False  # a dispatch's receive half was issued since construction or mask_ranks
        self._restarts = 0  # mask_ranks' restart generation (a plan's call)
        self._timing = _Timing(window) if cfg.timing else None
        self._raised_call = 0  # the call (epoch) of the last error raised
        self._raised_backward = 0  # the backward call of the last backward error raised (counted apart)
        mem = cupy.cuda.PinnedMemoryPointer(
            cupy.cuda.PinnedMemory(4 * C.ERROR_WORDS, cupy.cuda.runtime.hostAllocMapped), 0)
        self._err_mem, self.err = mem, np.frombuffer(mem, np.int32, C.ERROR_WORDS)
        self._code = self.err.data  # the same words as Python ints: the per-call check reads [0]
        self.err[:] = 0
        self.fixed = _abi.Fixed(
            state=self.state.data.ptr, err=mem.ptr, recv_buf=self.recv_buf.data.ptr,
            comb_buf=self.comb_buf.data.ptr, stage=self.stage.data.ptr, sig=self.sig[0].data.ptr,
            arrive=self.arrive[0].data.ptr, comb_arrive=self.arrive[1].data.ptr, own_of=self.own_of.data.ptr,
            ids_of=self.ids_of.data.ptr,
            comb_sig=self.sig[1].data.ptr, slot_of=self.slot_of.data.ptr, mask=self.mask.data.ptr,
            counters=self.counters.data.ptr, ring=self.ring.data.ptr, why=self.sig[2].data.ptr,
            ids=self.sig[3].data.ptr,
            drop_buf=0 if self.drop_buf is None else self.drop_buf.data.ptr,
            map=0 if self.map is None else self.map.data.ptr, peers=transport.peers.data.ptr,
            gone=transport.gone.data.ptr, timeout_ns=int(timeout_s * 1e9),
            world=W, rank=cfg.rank, dp=cfg.dp_size, num_experts=cfg.num_experts, local_experts=L, topk=K,
            max_tokens=M, hidden=cfg.hidden_dim, x_bytes=rec.x_bytes, scale_bytes=rec.scale_bytes,
            scale_item=0 if cfg.scale_dtype is None else cfg.scale_dtype.itemsize,
            scale_column=int(cfg.scale_layout == "column"), meta_off=rec.meta_off, rec_bytes=rec.size,
            out_code=_DT_CODES[np.dtype(cfg.out_dtype)], quant=_quant_code(cfg),
            src_code=_DT_CODES.get(np.dtype(cfg.in_dtype), 0), src_row_bytes=cfg.hidden_dim * cfg.in_dtype.itemsize,
            out_row_bytes=cfg.hidden_dim * cfg.out_dtype.itemsize, wire=C.WIRE_CODES[cfg.combine_wire],
            comb_row_bytes=_abi.combine_row_bytes(cfg), cap=cfg.expert_capacity, drop=int(cfg.drops),
            packed=pack(cfg), window=window, stage_slots=C.STAGE_SLOTS,
            stage_bytes=sizes["stage_row"],
            c_received=counters["received"], c_dropped=counters["dropped"], c_bytes=counters["bytes"],
            s_expert=state["expert"], s_recv=state["recv"], s_kept=state["kept"], s_claim=state["claim"],
            s_combined=state["combined"], num_tags=cfg.num_tags, tally_rows=self.tally_rows,
            senders=plan.senders, streamed=int(plan.streamed), comb_streamed=int(plan.combine_streams),
            **_pointers(sent=self.sent, grad_buf=self.grad_buf, grad_sig=self.grad_sig, grad_w=self.grad_w,
                        tag_ring=self.tag_ring, gap_ring=self.gap_ring),
            grad_row_bytes=_abi.grad_row_bytes(cfg))
        self._calls = {phase: _abi.Call() for phase in C.CALL_PHASES}  # the call records (records())
        self._folded = False  # the dispatch record carries sources (dispatch())
        self._skipped = _abi.Call(skip=1)  # the call record of a half issued with no data
        def records(n, call):  # Fixed, the call record, and the half of a kernel of both (deep_ep.cu)
            k = _abi.KERNELS[n]
            return (self.fixed, call) + ((_abi.Half(recv=k.half),) if _abi.Half in k.params else ())

        launch = {n: transport.launch(n, g, *records(n, self._calls[phase_of(n)]), module=self.module)
                  for n, g in plan.grids.items()
                  if n not in plan.backward.values() and n not in (SOURCE_LAYOUT, ROW_ROUTING)}  # its phase's record
        halves = {half: tuple(launch[n] for n in kernels) for half, kernels in plan.halves.items()}
        self._halves = {phase: (halves[phase + "_send"], halves[phase + "_recv"]) for phase in plan.whole}
        self._whole = {phase: tuple(launch[n] for n in kernels) for phase, kernels in plan.whole.items()}
        self._skip = {half: transport.launch(kernels[0], plan.grids[kernels[0]], *records(kernels[0], self._skipped),
                                             module=self.module) for half, kernels in plan.halves.items()}
        if cfg.gradients:
            slots = int(np.prod(cfg.expert_x_shape()[:-1]))
            self._grad, self._grad_skipped = _abi.Grad(slots=slots), _abi.Grad(slots=slots, skip=1)
            self._grads = [{op: transport.launch(n, plan.grids[n], self.fixed, record, module=self.module)
                            for op, n in plan.backward.items()}
                           for record in (self._grad, self._grad_skipped)]  # [0]: with data, [1]: skipped
        self._sources = _abi.Sources()
        self._source_layout = (transport.launch(SOURCE_LAYOUT, plan.grids[SOURCE_LAYOUT], self.fixed, self._sources,
                                                module=self.module) if SOURCE_LAYOUT in plan.grids else None)
        self._routing = _abi.RowRouting()
        self._row_routing = (transport.launch(ROW_ROUTING, plan.grids[ROW_ROUTING], self.fixed, self._routing,
                                              module=self.module) if ROW_ROUTING in plan.grids else None)
        transport.settle("AllToAll(...)")

    @property
    def gradients(self):
        return self.cfg.gradients

    def records(self):
        return self._calls

    # ------------------------------------------------------------------------------------------
    def check_error(self, timeout_only=False):
        """Raise the error a kernel recorded (no synchronization) and clear it; with ``timeout_only``, only
        a timeout (other errors wait for the end of a call). A call raises one error: what its kernels
        record after that (the consequences a peer's flag has on its last kernel) is dropped here."""
        code = self._code[0]
        if code != C.ERR_NONE and (code == C.ERR_TIMEOUT or not timeout_only):
            words = self.err.copy()
            self.err[:] = 0
            backward = words[2] >= C.PHASE_DISPATCH_BACKWARD  # backward calls are counted apart
            if code != C.ERR_TIMEOUT and words[4] <= (self._raised_backward if backward else self._raised_call):
                return
            if backward:
                self._raised_backward = int(words[4])
            else:
                self._raised_call = int(words[4])
            error = self.t.error_from_words(words, "AllToAll", self.cfg.expert_capacity)
            if backward:
                error.call = None  # not a dispatch/combine call: synchronize ends none
            raise error

    def synchronize(self, stream):
        _cuda.stream_synchronize(stream)
        self.check_error()

    def dispatch(self, record, do_send, do_recv, stream, sources=None):
        """``record``: the dispatch Call structure of records(), filled for this call; the kernels' prepared
        launches took its address at construction, so launching them is handing it over. ``sources`` (see
        write_sources) ride in the record's combine-only fields (y, out_tokens, out_dropped: CALL_FIELDS) where
        the plan's dispatch_sources says the whole dispatch writes them; else SOURCE_LAYOUT runs after it."""
        folded = sources is not None and do_send and do_recv and self.plan.dispatch_sources
        if folded or self._folded:  # set, or cleared after a call that set them
            record.y, record.out_tokens, record.out_dropped = sources if folded else (0, 0, 0)
            self._folded = folded
        self._launch("dispatch", do_send, do_recv, stream)
        self._dispatched = self._dispatched or do_recv
        if sources is not None and not folded:
            self.write_sources(*sources, stream)

    def combine(self, record, do_send, do_recv, stream):
        """``record``: the combine Call structure, as in :meth:`dispatch`."""
        self._launch("combine", do_send, do_recv, stream)
        if do_recv and not self.captured:
            self.check_error()

    def _launch(self, phase, do_send, do_recv, stream):
        """Launch the phase's send and/or receive kernels on ``stream`` (timed with timing=True); they read
        the phase's call record (records(), filled by AllToAll)."""
        if not self.captured:
            self.check_error(timeout_only=True)
        send, recv = self._halves[phase]
        if do_send and do_recv:
            send, recv = self._whole[phase], ()
        if do_send:
            if self._timing:
                self._timing.start(phase, stream)
            for kernel in send:
                kernel(stream)
        if do_recv:
            for kernel in recv:
                kernel(stream)
            if self._timing:
                self._timing.end(phase, stream)

    # gradients (cuda/backward.cu) ------------------------------------------------------------
    def write_plan(self, plan, stream):
        if not self._dispatched:
            raise InvalidArgument("plan: no dispatch has been received since construction or the last mask_ranks")
        g = self._grad
        g.expert, g.origin, g.call, g.held, g.local = plan
        g.generation = self._restarts
        self._cupy.cuda.runtime.memsetAsync(plan.origin, 0xFF, 12 * g.slots, stream)  # -1: empty slots
        self._cupy.cuda.runtime.memsetAsync(plan.local, 0xFF, 4 * self.cfg.max_num_tokens * self.cfg.experts_per_token,
                                            stream)  # -1: not on this rank
        self._cupy.cuda.runtime.memsetAsync(plan.held, 0, 4, stream)  # none held yet
        self._grads[0]["plan"](stream)

    def write_sources(self, src_info, layout_range, add_counts, stream):
        self._describe("source_layout", self._source_layout, self._sources, stream, src_info=src_info,
                       layout_range=layout_range, add_counts=add_counts)

    def write_row_routing(self, indices, idx64, weights, stream):
        self._describe("row_routing", self._row_routing, self._routing, stream, indices=indices, idx64=idx64,
                       weights=weights)

    def _describe(self, what, launch, record, stream, **fields):
        """Launch ``launch``, a kernel describing the last received dispatch (``what``: its AllToAll method), on
        ``stream`` with ``record``'s ``fields`` set."""
        if not self._dispatched:
            raise InvalidArgument(f"{what}: no dispatch has been received since construction or the last mask_ranks")
        for name, value in fields.items():
            setattr(record, name, value)
        launch(stream)

    def dispatch_backward(self, a, stream):
        self._run_backward("dispatch_backward", a, stream, a.out)

    def combine_backward(self, a, stream):
        self._run_backward("combine_backward", a, stream, a.out_grad_y)

    def _run_backward(self, phase, a, stream, out):
        """Fill the backward record from ``a`` (a moecomm.alltoall._Backward of device addresses) and launch
        ``phase``'s kernel on ``stream``."""
        if not self.captured:
            self.check_error(timeout_only=True)
        g = self._grad
        g.expert, g.origin, g.call, g.held, g.local = a.expert, a.origin, a.call, a.held, a.local
        g.bound_m, g.rows = a.bound_m, a.rows
        g.grad, g.out, g.grad_code, g.out_code = a.grad, out, _DT_CODES[a.grad_dtype], _DT_CODES[a.out_dtype]
        g.out_w, g.weights, g.y = a.out_grad_weights or 0, a.weights or 0, a.y or 0
        self._grads[0][phase](stream)
        if not self.captured:
            self.check_error()

    def skip_backward(self, phase, refusal, stream):
        self.check_error(timeout_only=True)
        self._grad_skipped.reason = refusal.code
        self._grads[1][phase](stream)

    def skip(self, halves, stream, refusal=None):
        """Launch ``halves`` with no data (Call.skip); their send halves' signals carry the refusal's code (the
        peers raise the first, once per call)."""
        s = self._cupy.cuda.get_current_stream().ptr if stream is None else stream
        for half in halves:
            self._skipped.reason = refusal.code if refusal is not None and half.endswith("_send") else 0
            self._skip[half](s)

    def set_mask(self, masked, generation, barrier):
        """Mask ``masked`` (ranks) from the next call on, after a resynchronization among the ranks outside
        it: every such rank finishes its work, then they all restart their epochs and signals from zero.
        ``barrier()`` waits for those ranks (bounded)."""
        mask = np.zeros(self.cfg.world_size, np.int32)
        mask[list(masked)] = 1
        _cuda.context_synchronize()  # this rank's kernels are bounded: this ends
        barrier()  # no unmasked rank has work in flight: nothing writes our signals any more
        stream = self._cupy.cuda.get_current_stream()
        self.state.fill(0)
        self.state[C.STATE_FIELDS.index("GEN")] = self._generation
        self.sig.fill(0)
        self.arrive.fill(0)  # call numbers restart: old arrival and drop words must not match new calls
        if self.drop_buf is not None:
            self.drop_buf.fill(0)
        for a in (self.grad_buf, self.grad_sig, self.grad_w):  # backward calls restart too
            if a is not None:
                a.fill(0)
        self.mask.set(mask)
        stream.synchronize()
        self.err[:] = 0
        self._raised_call = self._raised_backward = 0  # calls are numbered from 1 again
        self._dispatched, self._restarts = False, generation
        barrier()

    def snapshot(self):
        """The telemetry, after this rank's work on the GPU (see moecomm.transport.base.snapshot)."""
        _cuda.context_synchronize()
        at, W = _abi.counter_layout(self.cfg), self.cfg.world_size
        c = self.counters.get().astype(np.int64)
        calls = int(c[C.COUNTER_FIELDS.index("CALLS")])
        tags = self._windowed(self.tag_ring, calls, (self.cfg.num_tags, self.cfg.num_local_experts))
        gap = self._windowed(self.gap_ring, calls, (C.GAP_BINS,))
        return snapshot(c[:at["received"]], c[at["received"]:at["dropped"]], c[at["dropped"]:at["bytes"]],
                        c[at["bytes"]:].reshape(-1, W), self.ring.get(),
                        self._timing.times_us() if self._timing else None, self.plan.summary(),
                        tags if self.cfg.num_tags else None, gap if self.cfg.score_gap else None)

    def _windowed(self, ring, calls, shape):
        """A ring of tally_rows rows (call c's at c % tally_rows) rowed as snapshot() reads the window's:
        [window, *shape], call c's row at c % window."""
        out = np.zeros((self.window, *shape), np.int64)
        if ring is not None:
            c = np.arange(max(0, calls - self.window), calls)
            out[c % self.window] = ring.get()[c % self.tally_rows]
        return out

    def set_expert_map(self, expert_map):
        """The map's replica table and generation into device memory once the last call's stream has
        finished (the next dispatch reads them; a CUDA graph replayed later reads them too)."""
        W = self.cfg.world_size
        table = np.full((self.cfg.num_experts, 1 + W), -1, np.int32)
        t = expert_map.table()
        table[:, 0] = expert_map.replicas()
        table[:, 1:1 + t.shape[1]] = t
        self._generation = expert_map.generation % (1 << C.SIG_GEN_BITS)
        _cuda.context_synchronize()  # the last call no longer reads the map
        self.map.set(table)
        self.state[C.STATE_FIELDS.index("GEN")] = self._generation
        self._cupy.cuda.get_current_stream().synchronize()

    def destroy(self, collective):
        if not collective:  # a peer is gone: freeing symmetric memory would wait for it
            return
        _cuda.context_synchronize()
        self.check_error(timeout_only=True)  # a peer that died during the last call is named here
        self.t.settle("destroy")
        for a in self._owned:
            self.t.free(a)
        self._owned = []
        if self._timing:
            self._timing.destroy()


class _Timing:
    """``timing=True``: the device time of each phase (send half start to receive half end) from CUDA events
    recorded on the call's stream, for the last ``window`` calls. Not recorded while the stream is being
    captured into a CUDA graph (events of a capture cannot be timed)."""

    def __init__(self, window):
        self.window = window
        self.pending = {"dispatch": [], "combine": []}  # (start, end or None) event pairs, oldest first
        self.spare = []

    def _event(self):
        return self.spare.pop() if self.spare else _cuda.new_event()

    def start(self, phase, stream):
        if _cuda.is_capturing(stream):
            return
        ev = self._event()
        _cuda.record(ev, stream)
        pairs = self.pending[phase]
        pairs.append([ev, None])
        if len(pairs) > self.window:
            self.spare += [e for e in pairs.pop(0) if e is not None]

    def end(self, phase, stream):
        pairs = self.pending[phase]
        if not pairs or pairs[-1][1] is not None or _cuda.is_capturing(stream):
            return
        ev = self._event()
        _cuda.record(ev, stream)
        pairs[-1][1] = ev

    def times_us(self):
        """{phase: [microseconds per call]} of the calls whose events completed (the caller synchronized)."""
        return {phase: [1e3 * _cuda.elapsed_ms(a, b) for a, b in pairs if b is not None]
                for phase, pairs in self.pending.items()}

    def destroy(self):
        for pairs in self.pending.values():
            self.spare += [e for pair in pairs for e in pair if e is not None]
        for ev in self.spare:
            _cuda.destroy_event(ev)
        self.spare, self.pending = [], {"dispatch": [], "combine": []}
