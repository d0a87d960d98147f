"""Bootstrap: ``moecomm.init()`` turns an MPI communicator into a :class:`Communicator`."""
import atexit
import logging
import weakref

from ._constants import timeout_seconds
from ._errors import InvalidArgument

log = logging.getLogger("moecomm")

TRANSPORTS = ("auto", "host", "nvshmem")


def gpu_count():
    """CUDA devices visible to this process (0 without a driver or GPU)."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no driver, no libcuda, or CUDA refuses: no GPU for us
        return 0


class Communicator:
    """The ranks taking part in expert parallelism, and the transport that connects them.

    Attributes:
        mpi: the mpi4py communicator.
        rank, world_size: this process's rank and the number of ranks.
        local_rank, local_size: rank and count among the ranks sharing this node.
        transport: the :class:`moecomm.transport.Transport` in use (``.name`` is "host" or "nvshmem").
        device: CUDA device ordinal bound to this rank, or -1 on the host transport.
    """

    def __init__(self, mpi, transport_name, timeout=None):
        self.mpi = mpi
        self.rank, self.world_size = mpi.Get_rank(), mpi.Get_size()
        node = mpi.Split_type(_mpi().COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        node.Free()
        self.timeout_s, source = timeout_seconds(timeout)
        log.info("moecomm rank %d/%d: timeout %.3g s (from %s)", self.rank, self.world_size,
                 self.timeout_s, source)
        if transport_name == "host":
            from .transport.host import HostTransport
            self.transport = HostTransport(mpi)
        else:
            from .transport.nvshmem import NvshmemTransport
            self.transport = NvshmemTransport(mpi, self.local_rank, self.local_size)
        self.device = self.transport.device
        atexit.register(_finalize_at_exit, weakref.ref(self))

    def allgather(self, obj):
        """Gather one picklable object from every rank (collective)."""
        self._live()
        return self.mpi.allgather(obj)

    def barrier(self):
        """Wait for every rank (collective)."""
        self._live()
        self.mpi.Barrier()

    def check_peers(self, nbytes=4096, timeout=None):
        """Send ``nbytes`` to every rank through the transport and verify what arrives (collective).

        On GPUs this launches the peer-check kernel (NVSHMEM put with signal, bounded wait). Raises
        CommTimeout naming a silent peer, MoeCommError on wrong bytes.
        """
        self._live()
        if int(nbytes) <= 0:
            raise InvalidArgument(f"nbytes must be > 0, got {nbytes}")
        t = self.timeout_s if timeout is None else timeout_seconds(timeout)[0]
        self.transport.check_peers(int(nbytes), t)

    def symmetric(self, shape, dtype):
        """A CuPy array on the NVSHMEM symmetric heap (collective: same shapes, same order on all ranks).

        Contents are undefined. ``dtype`` must be one CuPy supports (uint8/uint16 for fp8/bf16 data).
        GPU transport only; free with :meth:`free` (collective) or at :meth:`finalize`.
        """
        return self._gpu("symmetric").symmetric(shape, dtype)

    def peer_array(self, array, pe):
        """Rank ``pe``'s copy of a symmetric ``array``, mapped for loads/stores over NVLink, or None when
        that rank is not load/store reachable (another node). GPU transport only."""
        return self._gpu("peer_array").peer_array(array, pe)

    def free(self, array):
        """Free an array from :meth:`symmetric` (collective, same order on every rank). GPU transport only."""
        self._gpu("free").free(array)

    def _gpu(self, what):
        self._live()
        if self.transport.memory != "device":
            raise InvalidArgument(f"{what}: symmetric memory needs the nvshmem transport, this communicator "
                                  f"uses {self.transport.name!r}")
        return self.transport

    def _live(self):
        if self.transport is None:
            raise InvalidArgument("this Communicator was finalized")

    def finalize(self):
        """Release the transport (NVSHMEM included). Collective; safe to call twice."""
        if getattr(self, "transport", None) is not None:
            t, self.transport = self.transport, None
            t.finalize()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.finalize()


def _finalize_at_exit(ref):
    comm = ref()
    if comm is not None:
        comm.finalize()


def _mpi():
    from mpi4py import MPI
    return MPI


def init(comm=None, transport="auto", timeout=None):
    """Create a :class:`Communicator` (collective over ``comm``).

    Args:
        comm: an mpi4py communicator (default ``MPI.COMM_WORLD``).
        transport: "nvshmem" (GPUs: binds GPU ``local_rank`` and starts NVSHMEM by unique id over MPI),
            "host" (CPU ranks, numpy arrays), or "auto": nvshmem when this process sees a GPU, else host.
            Every rank must make the same choice (checked).
        timeout: default seconds for bounded waits (else ``$MOECOMM_TIMEOUT_S``, else 10).
    """
    if transport not in TRANSPORTS:
        raise InvalidArgument(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    mpi = comm if comm is not None else _mpi().COMM_WORLD
    if transport == "auto":
        transport = "nvshmem" if gpu_count() > 0 else "host"
    chosen = mpi.allgather(transport)
    if len(set(chosen)) != 1:
        raise InvalidArgument(f"ranks chose different transports: {chosen}")
    return Communicator(mpi, transport, timeout)
