"""The NVSHMEM GPU transport: bootstrap, symmetric memory, kernel module, device error words.

Host side through nvshmem4py (``nvshmem.core`` for init, symmetric arrays and finalize;
``nvshmem.bindings`` for module registration and on-stream barriers). Two things of nvshmem4py 0.4.1 are
bypassed on purpose: ``nvshmem.core.module_init`` prints to stdout and ``module_finalize`` raises
``AttributeError`` as shipped, so the CUmodule is registered with ``nvshmem.bindings.cumodule_init`` /
``cumodule_finalize`` directly. Device code is built by :mod:`moecomm._jit` (nvshmem4py's device-bitcode
finder expects a file the NVSHMEM 3.4.5 wheel does not ship).

NVSHMEM is started by unique id: rank 0 creates the id, the bootstrap (MPI, torch.distributed, ...)
gathers its bytes to every rank, every rank calls ``nvshmem.core.init(..., initializer_method="uid")``
after binding GPU ``local_rank``. This needs no NVSHMEM build matched to the MPI library (its MPI
bootstrap plugin would). Everything runs in the primary context of the rank's GPU (``self.context``).
"""
import numpy as np

from .. import _abi, _cuda, _jit
from .. import _constants as C
from .._arrays import DeviceArrays
from .._errors import CommTimeout, InvalidArgument, InvalidRouting, MoeCommError, PeerError
from .base import Transport, peer_pattern


class NvshmemTransport(Transport):
    name = "nvshmem"
    memory = "device"

    def __init__(self, bootstrap, local_rank, local_size, timeout_s):
        import cupy
        import nvshmem.bindings
        import nvshmem.core

        self._nvshmem, self._bindings, self._cupy = nvshmem.core, nvshmem.bindings, cupy
        self.rank, self.world_size, self.bootstrap = bootstrap.rank, bootstrap.world_size, bootstrap
        self.timeout_s = timeout_s
        ndev = cupy.cuda.runtime.getDeviceCount()
        if ndev == 1:  # the launcher gave each rank its own GPU (srun --gpus-per-task=1, CUDA_VISIBLE_DEVICES)
            self.device = 0
        elif local_size <= ndev:
            self.device = local_rank
        else:
            raise MoeCommError(f"{local_size} ranks share this node but they see {ndev} GPUs: "
                               f"run at most one rank per GPU")
        self.context = _cuda.Context(self.device)
        previous = self.context.enter()  # NVSHMEM, the module and every CuPy array of ours live in it
        try:
            self._start()
        finally:  # a thread that had no current device keeps this one (CuPy code after init uses it)
            if previous is not _cuda.NO_CONTEXT:
                self.context.leave(previous)

    def _start(self):
        from cuda.core import Device
        dev = Device(self.device)
        dev.set_current()
        uid = self._nvshmem.get_unique_id(empty=self.rank != 0)
        uid_bytes = uid._data.view(np.uint8)
        uid_bytes[:] = np.frombuffer(self.bootstrap.allgather(uid_bytes.tobytes(), self.timeout_s, "init")[0],
                                     np.uint8)
        self._nvshmem.init(device=dev, uid=uid, rank=self.rank, nranks=self.world_size, initializer_method="uid")
        if self._nvshmem.my_pe() != self.rank:
            raise MoeCommError(f"NVSHMEM PE {self._nvshmem.my_pe()} != rank {self.rank}")
        major, minor = dev.compute_capability
        self.num_sms = dev.properties.multiprocessor_count
        self.build = _jit.build(f"sm_{major}{minor}")
        self.module = _cuda.Module(self.build.cubin)
        self._bindings.cumodule_init(int(self.module.handle))
        self._arrays = []       # symmetric arrays we own, freed in allocation order at finalize
        self._peer = None
        self._peer_checks = 0
        self.error = self._cupy.zeros(C.ERROR_WORDS, np.int32)  # device error word of eager checks
        self._peer_args = _abi.PeerCheck(err=self.error.data.ptr)
        self._peer_launch = self.launch("moecomm_peer_check", self.world_size, self._peer_args)
        self._peer_buffers()

    # symmetric memory -------------------------------------------------------------------------
    def symmetric(self, shape, dtype):
        """A CuPy array on the NVSHMEM symmetric heap (collective: same shapes, same order on all ranks).

        Contents are undefined (NVSHMEM does not zero memory). ``dtype`` must be one CuPy supports; use
        uint8 / uint16 for bfloat16 and float8 data.
        """
        with self.context:
            a = self._nvshmem.array(tuple(shape), dtype=np.dtype(dtype).name)
        self._arrays.append(a)
        return a

    def peer_array(self, array, pe):
        """``array`` of rank ``pe`` mapped for loads/stores (NVLink), or None when not addressable."""
        if pe == self.rank:
            return array
        with self.context:
            if not self._bindings.ptr(array.data.ptr, pe):
                return None
            return self._nvshmem.get_peer_array(array, pe)

    def free(self, array):
        """Free a symmetric array from :meth:`symmetric` (collective, same order on every rank)."""
        self._arrays = [a for a in self._arrays if a is not array]  # by identity: == is elementwise
        with self.context:
            self._nvshmem.free_array(array)

    def settle(self, what):
        """Finish this rank's work on CuPy's current stream, then wait for every rank (bounded by the
        timeout, over the bootstrap: CommTimeout names a rank that does not come). moecomm's own barriers."""
        with self.context:
            self._cupy.cuda.get_current_stream().synchronize()
        self.bootstrap.barrier(self.timeout_s, what)

    def barrier(self, stream=None):
        """nvshmem barrier_all ordered on ``stream`` (a handle; default CuPy's current stream). Unbounded: a
        dead rank stalls it; for benchmarks, which align the ranks' clocks with it."""
        with self.context:
            s = self._cupy.cuda.get_current_stream().ptr if stream is None else stream
            self._bindings.barrier_all_on_stream(s)

    def launch(self, name, blocks, *params):
        """A :class:`moecomm._cuda.Launch` of kernel ``name`` (see moecomm._abi.KERNELS) with ``params``."""
        kernel = _abi.KERNELS[name]
        with self.context:
            return _cuda.Launch(self.module.function(kernel), kernel, blocks, *params)


    def new_arrays(self):
        with self.context:
            return DeviceArrays(self.device, _cuda.StreamOrder(), _cuda.pointer_device)

    # peer check -------------------------------------------------------------------------------
    def _peer_buffers(self):
        """inbox [2, world, PEER_CHECK_BYTES] (double-buffered by check parity), outbox, signal counters."""
        if self._peer is None:  # allocated (collectively) at init: check_peers itself runs no collective
            n = C.PEER_CHECK_BYTES
            self._peer = (self.symmetric((2, self.world_size, n), np.uint8),
                          self.symmetric((n,), np.uint8), self.symmetric((self.world_size,), np.uint64))
            self._peer[2].fill(0)
            self.settle("init")
        return self._peer

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
        inbox, outbox, signals = self._peer_buffers()
        self._peer_checks += 1
        c = self._peer_checks
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
            raise error_from_words(words, "check_peers")
        got = box[:, :nbytes].get()
        expect = peer_pattern(np.arange(self.world_size), 0, nbytes) ^ (c & 0xFF)
        wrong = [int(p) for p in np.nonzero((got != expect).any(axis=1))[0]]
        if wrong:
            raise MoeCommError(f"check_peers: wrong bytes from ranks {wrong}")

    def new_alltoall(self, cfg, timeout_s, ident):
        from .nvshmem_alltoall import NvshmemAllToAll
        return NvshmemAllToAll(self, cfg, timeout_s)

    def finalize(self, collective):
        if not collective:  # a peer is gone: NVSHMEM's teardown would wait for it; the process exit frees all
            return
        with self.context:
            self._cupy.cuda.get_current_stream().synchronize()
            self.bootstrap.barrier(self.timeout_s, "finalize")
            for a in self._arrays:
                self._nvshmem.free_array(a)
            self._arrays = []
            self._bindings.cumodule_finalize(int(self.module.handle))
            self.module.unload()
            self._nvshmem.finalize()
        self.context.release()


def error_from_words(words, what):
    """The exception for a device error word ``(code, peer, phase, detail, call)`` recorded by a kernel; the
    kinds and classes are those the host transport raises for the same fault."""
    code, peer, phase, detail, call = (int(v) for v in words)
    phase_name = C.PHASES[phase] if 0 <= phase < len(C.PHASES) else str(phase)
    where = f"{what} {phase_name} (call {call})"
    if code == C.ERR_TIMEOUT:
        return CommTimeout(f"{where}: timed out waiting for rank {peer}", peer=peer, phase=phase_name)
    if code == C.ERR_PEER:
        return _peer_error(where, peer, detail & ((1 << C.REASON_ARG_SHIFT) - 1), detail >> C.REASON_ARG_SHIFT)
    if code == C.ERR_BAD_EXPERT:
        return InvalidRouting(f"{where}: this rank dispatched an expert id out of range or repeated in a row "
                              f"(token {detail}); no rank unpacked its tokens")
    if code == C.ERR_BAD_M:
        return InvalidRouting(f"{where}: this rank passed bound_m={detail}, outside [0, min(rows, "
                              f"max_num_tokens)]")
    if code == C.ERR_M_DIFFERS:
        return InvalidArgument(f"{where}: bound_m={detail} differs from the dispatched m; nothing was sent")
    if code == C.ERR_OVERFLOW:
        return MoeCommError(f"{where}: rank {peer} sent more than the buffers hold (detail {detail}): "
                            f"configurations differ or memory was corrupted")
    return MoeCommError(f"{where}: device error {code} (peer {peer}, detail {detail})")


_PEER_ROUTING = {C.ERR_BAD_EXPERT: "invalid expert ids", C.ERR_BAD_M: "bound_m out of range"}


def _peer_error(where, peer, reason, argument):
    """A peer flagged its part of a call as failed with ``reason`` (an ERR_* code)."""
    if reason in _PEER_ROUTING:
        return InvalidRouting(f"{where}: peers reported bad input (rank {peer}: {_PEER_ROUTING[reason]}); its "
                              f"tokens were not sent")
    if reason == C.ERR_M_DIFFERS:
        text = "bound_m differs from the dispatched m"
    elif reason == C.ERR_REFUSED:
        name = C.ARGUMENTS[argument] if 0 <= argument < len(C.ARGUMENTS) else f"argument {argument}"
        text = f"refused {name}"
    else:
        text = f"error {reason}"
    return PeerError(f"{where}: rank {peer} refused its call ({text}); it sent nothing", peer=peer, reason=text)
