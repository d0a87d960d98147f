"""What every GPU transport shares: the rank's GPU and context, its kernel module, launches, bounded
barriers, the peer check, device error words. A GPU transport subclasses :class:`GpuTransport` and
provides its device runtime (moecomm/transport/base.py lists the pieces; ipc.py is the small example):
``variant`` (its module in :data:`moecomm._jit.VARIANTS`), ``_start_runtime``, ``_load_module``,
``symmetric``, ``free``, ``peer_array``, ``peer_offsets`` and ``_stop_runtime``. Everything runs in the primary
context of the rank's GPU (``self.context``), entered by moecomm's entry points.
"""
import time

import numpy as np

from .. import _abi, _cuda, _jit
from .. import _constants as C
from .._arrays import DeviceArrays
from .._errors import (IDS_DIFFER, CapacityExceeded, CommTimeout, ExpertMapMismatch, InvalidArgument, InvalidRouting,
                       MoeCommError, OutOfStep, PeerError, PeerExited, weights_differ)
from .base import Transport, peer_pattern
from .gpu_alltoall import GpuAllToAll


DEPARTURE_WAIT_S = 0.5  # how long an error naming a departed peer waits for that peer's notice (its reason)


class GpuTransport(Transport):
    memory = "device"
    variant = ""

    def module_of(self, variant):
        """The loaded module of ``variant``: the transport's own, or the one a launch plan chose instead (its
        put-free twin, moecomm/transport/gpu_plan.py), loaded at first use."""
        if variant == self.variant:
            return self.module
        if variant not in self._other_modules:
            self._other_modules[variant] = _cuda.Module(_jit.build(self.build.arch, variant).cubin)
        return self._other_modules[variant]

    def __init__(self, bootstrap, local_rank, local_size, timeout_s, device=None):
        import cupy
        self._cupy = cupy
        self.rank, self.world_size, self.bootstrap = bootstrap.rank, bootstrap.world_size, bootstrap
        self.timeout_s = timeout_s
        ndev = cupy.cuda.runtime.getDeviceCount()
        if device is not None:
            if not 0 <= device < ndev:
                raise InvalidArgument(f"device={device}: this process sees {ndev} GPUs")
            self.device = device
        elif ndev == 1:  # the launcher gave each rank its own GPU (srun --gpus-per-task=1, CUDA_VISIBLE_DEVICES)
            self.device = 0
        elif local_size <= ndev:
            self.device = local_rank
        else:
            raise MoeCommError(f"{local_size} ranks share this node but they see {ndev} GPUs: "
                               f"run at most one rank per GPU")
        self.context = _cuda.Context(self.device)
        previous = self.context.enter()  # the runtime, the module and every CuPy array of ours live in it
        try:
            self._start()
        finally:  # a thread that had no current device keeps this one (CuPy code after init uses it)
            if previous != _cuda.NO_CONTEXT:
                self.context.leave(previous)

    def _start(self):
        from cuda.core import Device
        dev = Device(self.device)
        dev.set_current()
        self._start_runtime(dev)
        major, minor = dev.compute_capability
        self.num_sms = dev.properties.multiprocessor_count
        self.build = _jit.build(f"sm_{major}{minor}", self.variant)
        self._programmatic = 100 * major + 10 * minor >= C.PROGRAMMATIC_ARCH  # dependent kernels: launch()
        self.module = _cuda.Module(self.build.cubin)
        self._load_module(self.module)
        self._other_modules = {}  # {variant: module} of the launch plans' other modules (module_of)
        self.error = self._cupy.zeros(C.ERROR_WORDS, np.int32)  # device error word of eager checks
        self._checks = {"peer_check": 0, "barrier": 0}  # peer checks and device barriers so far
        n = C.PEER_CHECK_BYTES  # inbox [2, world, n] (double-buffered by check parity), outbox, signals
        self._peer = (self.symmetric((2, self.world_size, n), np.uint8), self.symmetric((n,), np.uint8),
                      self.symmetric((self.world_size,), np.uint64))
        # [world] uint64: gone[q] != 0 once rank q has left (leave()); every bounded wait of the kernels reads it
        self.gone = self.symmetric((self.world_size,), np.uint64)
        self.gone.fill(0)
        # [world] int64, how every kernel reaches each rank (cuda/transport.cuh, peer_ptr)
        self.peers = self._cupy.asarray(np.array(self.peer_offsets(), np.int64))
        # whether every rank maps every peer: agreed here, so that every rank picks the same kernels (kernels)
        mine = bytes([maps_every_peer(self.peer_offsets())])
        self.all_mapped = all(d == b"\x01" for d in self.bootstrap.allgather(mine, self.timeout_s, "init"))
        self._peer_args = _abi.PeerCheck(err=self.error.data.ptr, peers=self.peers.data.ptr, gone=self.gone.data.ptr,
                                         rank=self.rank, world=self.world_size)
        self._peer_launch = self.launch("moecomm_peer_check", self.world_size, self._peer_args)
        self._barrier_signals = self.symmetric((self.world_size,), np.uint64)
        self._barrier_args = _abi.PeerCheck(err=self.error.data.ptr, peers=self.peers.data.ptr,
                                            gone=self.gone.data.ptr, rank=self.rank, world=self.world_size,
                                            signals=self._barrier_signals.data.ptr, inbox=self._peer[0].data.ptr,
                                            outbox=self._peer[1].data.ptr, timeout_ns=int(self.timeout_s * 1e9))
        self._barrier_launch = self.launch("moecomm_peer_check", self.world_size, self._barrier_args)
        self._peer[2].fill(0)
        self._barrier_signals.fill(0)
        self.settle("init")

    # the runtime a subclass provides -------------------------------------------------------------
    def _start_runtime(self, dev):
        raise NotImplementedError

    def _load_module(self, module):
        raise NotImplementedError

    def _stop_runtime(self):
        raise NotImplementedError

    def symmetric(self, shape, dtype):
        """A CuPy array at the same offset of every rank's symmetric memory (collective: same shapes, same
        order on all ranks). Contents are undefined. ``dtype`` must be one CuPy supports; use uint8 /
        uint16 for bfloat16 and float8 data."""
        raise NotImplementedError

    def free(self, array):
        """Free a symmetric array from :meth:`symmetric` (collective, same order on every rank)."""
        raise NotImplementedError

    def peer_array(self, array, pe):
        """``array`` of rank ``pe`` mapped for loads/stores, or None when not addressable."""
        raise NotImplementedError

    def peer_offsets(self):
        """The peer table, [world] ints: for each rank, the offset from this rank's symmetric memory to that
        rank's copy of it as mapped here, or ``PEER_UNMAPPED`` where it is not load/store reachable (it is then
        reached by puts). One offset per rank for every symmetric array."""
        raise NotImplementedError

    # shared -------------------------------------------------------------------------------------
    def settle(self, what):
        """Finish this rank's work on CuPy's current stream, then wait for every rank (bounded by the
        timeout, over the bootstrap: CommTimeout names a rank that does not come). moecomm's own barriers."""
        with self.context:
            self._cupy.cuda.get_current_stream().synchronize()
        self.bootstrap.barrier(self.timeout_s, what)

    def barrier(self, stream=None):
        """A device barrier of every rank ordered on ``stream`` (a handle; default CuPy's current stream):
        the peer-check kernel with no bytes, each rank signalling every rank and waiting, bounded by the
        timeout (a timeout lands in the transport's error word). For benchmarks, which align the ranks'
        clocks with it; the host does not wait."""
        self._checks["barrier"] += 1
        self._barrier_args.expected = self._checks["barrier"]
        with self.context:
            self._barrier_launch(self._cupy.cuda.get_current_stream().ptr if stream is None else stream)

    def launch(self, name, blocks, *params, module=None):
        """A :class:`moecomm._cuda.Launch` of kernel ``name`` (see moecomm._abi.KERNELS) with ``params``, from
        ``module`` (default: the transport's own); a programmatic dependent launch where the kernel is
        dependent and the GPU has them."""
        kernel = _abi.KERNELS[name]
        with self.context:
            return _cuda.Launch((module or self.module).function(kernel), kernel, blocks, *params,
                                programmatic=kernel.dependent and self._programmatic)

    def new_arrays(self, max_rows):
        with self.context:
            return DeviceArrays(self.device, _cuda.StreamOrder(), _cuda.pointer_device, max_rows)

    def new_alltoall(self, cfg, timeout_s, ident):
        return GpuAllToAll(self, cfg, timeout_s)

    def leave(self, drain=False):
        """Set gone[this rank] on every peer this rank maps (copies on a stream of its own, so that kernels of
        this rank still waiting do not hold them up; with ``drain`` after those have ended, bounded): their
        kernels' waits for this rank end at once (a peer reached only by puts learns of it from its own
        timeout, its host from the bootstrap)."""
        cp = self._cupy
        with self.context:
            if drain:
                _cuda.context_synchronize()
            one = np.ones(1, np.uint64)
            stream = cp.cuda.Stream(non_blocking=True)
            mine = self.gone.data.ptr + 8 * self.rank
            for q, offset in enumerate(self.peer_offsets()):
                if q != self.rank and offset != C.PEER_UNMAPPED:
                    cp.cuda.runtime.memcpyAsync(mine + offset, one.ctypes.data, 8, cp.cuda.runtime.memcpyHostToDevice,
                                                stream.ptr)
            stream.synchronize()

    def error_from_words(self, words, what, capacity=0):
        """:func:`error_from_words`, with the reason a departed peer gave: its notice through the bootstrap,
        which may land just after its departure word (waited for up to DEPARTURE_WAIT_S)."""
        if int(words[0]) == C.ERR_TIMEOUT and int(words[3]) == C.TIMEOUT_LEFT:
            deadline = time.monotonic() + DEPARTURE_WAIT_S
            while not self.bootstrap.departed([int(words[1])]) and time.monotonic() < deadline:
                time.sleep(1e-3)
        return error_from_words(words, what, capacity, self.bootstrap.departed)

    def check_peers(self, nbytes, timeout_s):
        """Peer-check kernel: no host collective and no barrier, so a silent peer can only time out.

        Check number c (1, 2, ...) sends pattern ^ c into inbox[c % 2] of every rank and adds 1 to the
        receiver's signal; a peer can reach check c + 2 (reusing inbox[c % 2]) only after this rank's
        signal for c + 1, i.e. after this rank has read check c.
        """
        if nbytes > C.PEER_CHECK_BYTES:
            raise InvalidArgument(f"check_peers: nbytes={nbytes} exceeds {C.PEER_CHECK_BYTES}")
        with self.context:
            self._check_peers(nbytes, timeout_s)

    def _check_peers(self, nbytes, timeout_s):
        cp = self._cupy
        inbox, outbox, signals = self._peer
        self._checks["peer_check"] += 1
        c = self._checks["peer_check"]
        outbox[:nbytes] = cp.asarray(peer_pattern(self.rank, 0, nbytes) ^ (c & 0xFF))
        box = inbox[c % 2]
        p = self._peer_args
        p.inbox, p.outbox, p.signals = box.data.ptr, outbox.data.ptr, signals.data.ptr
        p.expected, p.nbytes, p.row_bytes, p.timeout_ns = c, nbytes, box.shape[1], int(timeout_s * 1e9)
        stream = cp.cuda.get_current_stream()
        self._peer_launch(stream.ptr)
        stream.synchronize()
        words = self.error.get()
        if words[0] != C.ERR_NONE:
            self.error.fill(0)
            raise self.error_from_words(words, "check_peers")
        got = box[:, :nbytes].get()
        expect = peer_pattern(np.arange(self.world_size), 0, nbytes) ^ (c & 0xFF)
        wrong = [int(p) for p in np.nonzero((got != expect).any(axis=1))[0]]
        if wrong:
            raise MoeCommError(f"check_peers: wrong bytes from ranks {wrong}")

    def finalize(self, collective):
        if not collective:  # a peer is gone: a collective teardown would wait for it; the process exit frees all
            return
        with self.context:
            self._cupy.cuda.get_current_stream().synchronize()
            self.bootstrap.barrier(self.timeout_s, "finalize")
            for module in self._other_modules.values():
                module.unload()
            self._stop_runtime()
        self.context.release()


def maps_every_peer(offsets):
    """Whether a peer table (GpuTransport.peer_offsets) maps every rank for loads and stores, in a build that
    does not force puts (MOECOMM_FORCE_PUTS)."""
    return C.PEER_UNMAPPED not in offsets and not C.device_constants()["FORCE_PUTS"]


def error_from_words(words, what, capacity=0, departed=None):
    """The exception for a device error word ``(code, peer, phase, detail, call, amount)`` recorded by a
    kernel; the kinds and classes are those the host transport raises for the same fault. ``capacity``: the
    AllToAll's, named by CapacityExceeded; ``departed``: the bootstrap's departure notices ({rank: reason}
    of given ranks), for a peer that left. The exception's ``call`` attribute is the call's number."""
    error = _error(*(int(v) for v in words), what, capacity, departed)
    error.call = int(words[4])
    return error


def _plan_call(word):
    """A plan's call as its signals carry it (cuda/backward.cu, plan_word), in words."""
    word &= 0xFFFFFFFF
    return f"{word & ((1 << C.PLAN_CALL_BITS) - 1)} (generation {word >> C.PLAN_CALL_BITS})"


def _error(code, peer, phase, detail, call, amount, what, capacity, departed):
    phase_name = C.PHASES[phase] if 0 <= phase < len(C.PHASES) else str(phase)
    where = f"{what} {phase_name} (call {call})"
    if code == C.ERR_TIMEOUT and detail == C.TIMEOUT_LEFT:
        reason = (departed([peer]) if departed else {}).get(peer, "it said it was leaving")
        return PeerExited(f"{where}: rank {peer} left the job ({reason})", peer=peer, phase=phase_name, reason=reason)
    if code == C.ERR_TIMEOUT:
        return CommTimeout(f"{where}: timed out waiting for rank {peer}", peer=peer, phase=phase_name)
    if code == C.ERR_PEER:
        reason, argument = detail & ((1 << C.REASON_ARG_SHIFT) - 1), detail >> C.REASON_ARG_SHIFT
        if reason == C.ERR_CAPACITY:
            return _capacity_error(where, argument - 1, amount, capacity, f"rank {peer} reported it")
        return _peer_error(where, peer, reason, argument)
    if code == C.ERR_CAPACITY:
        return _capacity_error(where, detail, amount, capacity, "on this rank")
    if code == C.ERR_GENERATION:
        return ExpertMapMismatch(f"{where}: rank {peer} routed with expert map generation {detail} (mod "
                                 f"{1 << C.SIG_GEN_BITS}), this rank with {amount}: its tokens were not unpacked "
                                 f"(set_expert_map is collective)")
    if code == C.ERR_BAD_EXPERT:
        return InvalidRouting(f"{where}: this rank dispatched an expert id out of range or repeated in a row "
                              f"(token {detail}); no rank unpacked its tokens")
    if code == C.ERR_CALL_ID:
        return OutOfStep(f"{where}: rank {peer}'s dispatch is the program's call {detail} (call_id), this rank's "
                         f"call {amount} (-1: none given): a rank skipped or repeated a call; its tokens were not "
                         f"unpacked")
    if code == C.ERR_BAD_TAG:
        return InvalidArgument(f"{where}: tags: token {detail}: tag {amount} is outside [0, num_tags); no rank "
                               f"unpacked its tokens")
    if code == C.ERR_BAD_M:
        return InvalidRouting(f"{where}: this rank passed bound_m={detail}, outside [0, {amount}] (at most "
                              f"max_num_tokens and the rows of each per-token array of the call)")
    if code == C.ERR_PLAN_DIFFERS and detail == -1:
        return InvalidArgument(f"{where}: rank {peer} sent no gradient for a pair this rank's plan holds (slot "
                               f"{amount}): the ranks' plans differ")
    if code == C.ERR_PLAN_DIFFERS and detail == -2:
        return InvalidArgument(f"{where}: plan.origin holds an entry out of range at slot {amount}: not a plan "
                               f"of this AllToAll")
    if code == C.ERR_PLAN_DIFFERS:
        return InvalidArgument(f"{where}: rank {peer} follows the routing plan of dispatch call {_plan_call(detail)},"
                               f" this rank that of call {_plan_call(amount)}: every rank passes the plan of the "
                               f"same call")
    if code == C.ERR_PLAN_M:
        return InvalidArgument(f"{where}: plan: it has pairs for tokens >= m={detail}: it is another call's plan")
    if code == C.ERR_ORDER and phase_name == "combine":
        return OutOfStep(f"{where}: a combine ran with no dispatch of its own before it on this GPU (calls "
                         f"replayed without the host ran out of order: a combine run twice, or before its "
                         f"dispatch); it combined nothing")
    if code == C.ERR_ORDER:
        return OutOfStep(f"{where}: a dispatch began before the previous call's combine ran on this GPU (calls "
                         f"replayed without the host ran out of order: an operation run twice, or a combine skipped)")
    if code == C.ERR_IDS_DIFFER:
        return InvalidArgument(f"{where}: {IDS_DIFFER}")
    if code == C.ERR_WEIGHTS_DIFFER:
        return InvalidArgument(f"{where}: {weights_differ(peer, detail, int(not detail))}")
    if code == C.ERR_M_DIFFERS:
        return InvalidArgument(f"{where}: bound_m={detail} differs from the dispatched m; nothing was sent")
    if code == C.ERR_OVERFLOW:
        return MoeCommError(f"{where}: rank {peer} sent more than the buffers hold (detail {detail}): "
                            f"configurations differ or memory was corrupted")
    return MoeCommError(f"{where}: device error {code} (peer {peer}, detail {detail})")


def _capacity_error(where, expert, demand, capacity, who):
    """``expert`` -1: the packed layout's per-rank rows."""
    what = f"expert {expert}" if expert >= 0 else "the rank's packed rows"
    return CapacityExceeded(f"{where}: {what} got {demand} (token, expert) pairs, capacity {capacity} ({who}); "
                            f"pairs past the capacity were not stored, and the call's combine sent nothing from "
                            f"that rank", expert=expert, demand=demand, capacity=capacity)


_PEER_ROUTING = {C.ERR_BAD_EXPERT: "invalid expert ids", C.ERR_BAD_M: "bound_m out of range"}


def _peer_error(where, peer, reason, argument):
    """A peer flagged its part of a call as failed with ``reason`` (an ERR_* code)."""
    if reason in _PEER_ROUTING:
        return InvalidRouting(f"{where}: peers reported bad input (rank {peer}: {_PEER_ROUTING[reason]}); its "
                              f"tokens were not sent")
    if reason == C.ERR_M_DIFFERS:
        text = "bound_m differs from the dispatched m"
    elif reason == C.ERR_PLAN_M:
        text = "its routing plan has pairs for tokens >= bound_m"
    elif reason == C.ERR_PLAN_DIFFERS:
        text = "the ranks' routing plans differ"
    elif reason == C.ERR_ORDER:
        text = "its calls ran out of order on its GPU"
    elif reason == C.ERR_ENDED:
        text = "it ended the call after an error of it"
    elif reason == C.ERR_REFUSED:
        name = C.ARGUMENTS[argument] if 0 <= argument < len(C.ARGUMENTS) else f"argument {argument}"
        text = f"refused {name}"
    else:
        text = f"error {reason}"
    return PeerError(f"{where}: rank {peer} refused its call ({text}); it sent nothing", peer=peer, reason=text)
