"""The NVSHMEM GPU transport: bootstrap, symmetric memory, kernel module, device error words.

Host side through nvshmem4py (``nvshmem.core`` for init, symmetric arrays and finalize;
``nvshmem.bindings`` for module registration and on-stream barriers). Two things of nvshmem4py 0.4.1 are
bypassed on purpose: ``nvshmem.core.module_init`` prints to stdout and ``module_finalize`` raises
``AttributeError`` as shipped, so the CUmodule is registered with ``nvshmem.bindings.cumodule_init`` /
``cumodule_finalize`` directly. Device code is built by :mod:`moecomm._jit` (nvshmem4py's device-bitcode
finder expects a file the NVSHMEM 3.4.5 wheel does not ship).

NVSHMEM is started by unique id: rank 0 creates the id, MPI broadcasts its bytes, every rank calls
``nvshmem.core.init(..., initializer_method="uid")`` after binding GPU ``local_rank``. This needs no
NVSHMEM build matched to the MPI library (its MPI bootstrap plugin would).
"""
import numpy as np

from .. import _constants as C
from .. import _jit
from .._errors import CommTimeout, InvalidArgument, InvalidRouting, MoeCommError
from .base import Transport, peer_pattern


class NvshmemTransport(Transport):
    name = "nvshmem"
    memory = "device"

    def __init__(self, mpi, local_rank, local_size):
        import cupy
        import nvshmem.bindings
        import nvshmem.core
        from cuda.core import Device

        self._nvshmem, self._bindings, self._cupy = nvshmem.core, nvshmem.bindings, cupy
        rank, world = mpi.Get_rank(), mpi.Get_size()
        ndev = cupy.cuda.runtime.getDeviceCount()
        if ndev == 1:  # the launcher gave each rank its own GPU (srun --gpus-per-task=1, CUDA_VISIBLE_DEVICES)
            self.device = 0
        elif local_size <= ndev:
            self.device = local_rank
        else:
            raise MoeCommError(f"{local_size} ranks share this node but they see {ndev} GPUs: "
                               f"run at most one rank per GPU")
        cupy.cuda.Device(self.device).use()
        dev = Device(self.device)
        dev.set_current()
        uid = nvshmem.core.get_unique_id(empty=rank != 0)
        mpi.Bcast(uid._data.view(np.int8), root=0)
        nvshmem.core.init(device=dev, uid=uid, rank=rank, nranks=world, initializer_method="uid")
        if nvshmem.core.my_pe() != rank:
            raise MoeCommError(f"NVSHMEM PE {nvshmem.core.my_pe()} != MPI rank {rank}")
        self.rank, self.world_size, self.mpi = rank, world, mpi
        major, minor = dev.compute_capability
        self.build = _jit.build(f"sm_{major}{minor}")
        self.module = cupy.cuda.function.Module()
        self.module.load(self.build.cubin)
        nvshmem.bindings.cumodule_init(self.module.ptr)
        self._arrays = []       # symmetric arrays we own, freed in allocation order at finalize
        self._peer = None
        self._peer_checks = 0
        self.error = cupy.zeros(C.ERROR_WORDS, np.int32)  # device error word of eager checks
        self._peer_buffers()

    # symmetric memory -------------------------------------------------------------------------
    def symmetric(self, shape, dtype):
        """A CuPy array on the NVSHMEM symmetric heap (collective: same shapes, same order on all ranks).

        Contents are undefined (NVSHMEM does not zero memory). ``dtype`` must be one CuPy supports; use
        uint8 / uint16 for bfloat16 and float8 data.
        """
        a = self._nvshmem.array(tuple(shape), dtype=np.dtype(dtype).name)
        self._arrays.append(a)
        return a

    def peer_array(self, array, pe):
        """``array`` of rank ``pe`` mapped for loads/stores (NVLink), or None when not addressable."""
        if pe == self.rank:
            return array
        if not self._bindings.ptr(array.data.ptr, pe):
            return None
        return self._nvshmem.get_peer_array(array, pe)

    def free(self, array):
        """Free a symmetric array from :meth:`symmetric` (collective, same order on every rank)."""
        self._arrays = [a for a in self._arrays if a is not array]  # by identity: == is elementwise
        self._nvshmem.free_array(array)

    def barrier(self, stream=None):
        """nvshmem barrier_all ordered on ``stream`` (a handle; default CuPy's current stream)."""
        s = self._cupy.cuda.get_current_stream().ptr if stream is None else stream
        self._bindings.barrier_all_on_stream(s)

    def function(self, name):
        return self.module.get_function(name)

    # peer check -------------------------------------------------------------------------------
    def _peer_buffers(self):
        """inbox [2, world, PEER_CHECK_BYTES] (double-buffered by check parity), outbox, signal counters."""
        if self._peer is None:  # allocated (collectively) at init: check_peers itself runs no collective
            cp, n = self._cupy, C.PEER_CHECK_BYTES
            self._peer = (self.symmetric((2, self.world_size, n), np.uint8),
                          self.symmetric((n,), np.uint8), self.symmetric((self.world_size,), np.uint64))
            self._peer[2].fill(0)
            cp.cuda.get_current_stream().synchronize()
            self.barrier()
            cp.cuda.get_current_stream().synchronize()
        return self._peer

    def check_peers(self, nbytes, timeout_s):
        """Peer-check kernel: no host collective and no barrier, so a silent peer can only time out.

        Check number c (1, 2, ...) sends pattern ^ c into inbox[c % 2] of every rank and adds 1 to the
        receiver's signal; a peer can reach check c + 2 (reusing inbox[c % 2]) only after this rank's
        signal for c + 1, i.e. after this rank has read check c.
        """
        cp = self._cupy
        if nbytes > C.PEER_CHECK_BYTES:
            raise InvalidArgument(f"check_peers: nbytes={nbytes} exceeds {C.PEER_CHECK_BYTES}")
        inbox, outbox, signals = self._peer_buffers()
        self._peer_checks += 1
        c = self._peer_checks
        outbox[:nbytes] = cp.asarray(peer_pattern(self.rank, 0, nbytes) ^ (c & 0xFF))
        box = inbox[c % 2]
        self.function("moecomm_peer_check")(
            (self.world_size,), (32,),
            (box, outbox, signals, np.uint64(c), np.uint64(nbytes), np.uint64(box.shape[1]),
             np.uint64(int(timeout_s * 1e9)), self.error))
        cp.cuda.get_current_stream().synchronize()
        words = self.error.get()
        if words[0] != C.ERR_NONE:
            self.error.fill(0)
            raise error_from_words(words, "check_peers")
        got = box[:, :nbytes].get()
        expect = peer_pattern(np.arange(self.world_size), 0, nbytes) ^ (c & 0xFF)
        wrong = [int(p) for p in np.nonzero((got != expect).any(axis=1))[0]]
        if wrong:
            raise MoeCommError(f"check_peers: wrong bytes from ranks {wrong}")

    def new_alltoall(self, cfg, timeout_s):
        from .nvshmem_alltoall import NvshmemAllToAll
        return NvshmemAllToAll(self, cfg, timeout_s)

    def finalize(self):
        self._cupy.cuda.get_current_stream().synchronize()
        self.mpi.Barrier()
        for a in self._arrays:
            self._nvshmem.free_array(a)
        self._arrays = []
        self._bindings.cumodule_finalize(self.module.ptr)
        self._nvshmem.finalize()


def error_from_words(words, what):
    """The exception for a device error word ``(code, peer, phase, detail)`` recorded by a kernel."""
    code, peer, phase, detail = (int(v) for v in words)
    phase_name = C.PHASES[phase] if 0 <= phase < len(C.PHASES) else str(phase)
    if code == C.ERR_TIMEOUT:
        return CommTimeout(f"{what}: timed out in {phase_name} waiting for rank {peer}", peer=peer,
                           phase=phase_name)
    if code == C.ERR_BAD_EXPERT:
        where = f" (token {detail})" if detail >= 0 else ""
        return InvalidRouting(f"{what}: rank {peer} dispatched an expert id out of range or repeated in a "
                              f"row{where}; no rank unpacked its tokens")
    if code == C.ERR_BAD_M:
        return InvalidRouting(f"{what}: rank {peer} passed bound_m={detail}, outside [0, min(rows, "
                              f"max_num_tokens)]")
    if code == C.ERR_OVERFLOW:
        return MoeCommError(f"{what}: rank {peer} sent more than the buffers hold in {phase_name} "
                            f"(detail {detail}): configurations differ or memory was corrupted")
    return MoeCommError(f"{what}: device error {code} in {phase_name} (peer {peer}, detail {detail})")
