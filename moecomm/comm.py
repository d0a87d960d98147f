"""Bootstrap: ``moecomm.init()`` turns the program's process group into a :class:`Communicator`.

moecomm needs little from the launcher: ranks that can gather bytes from each other and wait for each
other. That is the :class:`Bootstrap` interface; mpi4py communicators (the default) and
``torch.distributed`` process groups are adapted to it here, and a JAX or custom runtime can implement
it in a few lines. The GPU transport needs nothing else; the host transport moves its data over MPI and
so needs an mpi4py communicator.
"""
import abc
import atexit
import logging
import pickle
import socket
import weakref

from ._constants import timeout_seconds
from ._errors import InvalidArgument, MoeCommError

log = logging.getLogger("moecomm")

TRANSPORTS = ("auto", "host", "nvshmem")


class Bootstrap(abc.ABC):
    """The process group moecomm starts from. Implement it to start moecomm from any runtime.

    Attributes:
        rank: this process's rank, 0 <= rank < world_size.
        world_size: number of processes.
    """
    rank = 0
    world_size = 1

    @abc.abstractmethod
    def allgather(self, data: bytes) -> list:
        """Collective: every rank passes ``data`` (bytes); returns the list of every rank's bytes, by rank."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Collective: return once every rank has called it."""


class MpiBootstrap(Bootstrap):
    """An mpi4py communicator (``mpi`` attribute: the communicator itself)."""

    def __init__(self, mpi):
        self.mpi = mpi
        self.rank, self.world_size = mpi.Get_rank(), mpi.Get_size()

    def allgather(self, data):
        return self.mpi.allgather(bytes(data))

    def barrier(self):
        self.mpi.Barrier()


class TorchBootstrap(Bootstrap):
    """A ``torch.distributed`` process group (e.g. under torchrun). With the NCCL backend, torch's current
    device must be this rank's GPU (``torch.cuda.set_device``), as torch.distributed itself requires."""

    def __init__(self, group):
        import torch.distributed as dist
        self._dist, self.group = dist, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    def allgather(self, data):
        out = [None] * self.world_size
        self._dist.all_gather_object(out, bytes(data), group=self.group)
        return out

    def barrier(self):
        self._dist.barrier(group=self.group)


def bootstrap_of(comm):
    """The Bootstrap for ``comm``: None (MPI.COMM_WORLD), an mpi4py communicator, a torch.distributed
    process group, or a Bootstrap."""
    if isinstance(comm, Bootstrap):
        return comm
    if comm is None:
        return MpiBootstrap(_mpi().COMM_WORLD)
    module = type(comm).__module__
    if module.startswith("mpi4py"):
        return MpiBootstrap(comm)
    if module.startswith("torch"):
        return TorchBootstrap(comm)
    raise InvalidArgument(f"comm: expected an mpi4py communicator, a torch.distributed process group or a "
                          f"moecomm.Bootstrap, got {type(comm).__name__}")


def _node_id():
    """Names this machine: host name and boot id (containers on different hosts may share a host name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


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
        bootstrap: the :class:`Bootstrap` it was started from.
        mpi: the mpi4py communicator, or None when started from another runtime.
        rank, world_size: this process's rank and the number of ranks.
        local_rank, local_size: rank and count among the ranks sharing this node.
        transport: the :class:`moecomm.transport.Transport` in use (``.name`` is "host" or "nvshmem").
        device: CUDA device ordinal bound to this rank, or -1 on the host transport.
    """

    def __init__(self, bootstrap, transport_name, timeout=None):
        self.bootstrap = bootstrap
        self.mpi = getattr(bootstrap, "mpi", None)
        self.rank, self.world_size = bootstrap.rank, bootstrap.world_size
        nodes = self._allgather(_node_id())
        here = [r for r, n in enumerate(nodes) if n == nodes[self.rank]]
        self.local_rank, self.local_size = here.index(self.rank), len(here)
        self.timeout_s, source = timeout_seconds(timeout)
        log.info("moecomm rank %d/%d: timeout %.3g s (from %s)", self.rank, self.world_size,
                 self.timeout_s, source)
        if transport_name == "host":
            from .transport.host import HostTransport
            self.transport = HostTransport(self.mpi)
        else:
            from .transport.nvshmem import NvshmemTransport
            self.transport = NvshmemTransport(bootstrap, self.local_rank, self.local_size)
        self.device = self.transport.device
        atexit.register(_finalize_at_exit, weakref.ref(self))

    def allgather(self, obj):
        """Gather one picklable object from every rank (collective)."""
        self._live()
        return self._allgather(obj)

    def _allgather(self, obj):
        return [pickle.loads(b) for b in self.bootstrap.allgather(pickle.dumps(obj))]

    def barrier(self):
        """Wait for every rank (collective)."""
        self._live()
        self.bootstrap.barrier()

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
        comm: the process group: an mpi4py communicator (default ``MPI.COMM_WORLD``), a
            ``torch.distributed`` process group (e.g. ``torch.distributed.group.WORLD`` under torchrun),
            or any :class:`Bootstrap`.
        transport: "nvshmem" (GPUs: binds GPU ``local_rank`` and starts NVSHMEM by a unique id gathered
            through ``comm``), "host" (CPU ranks, numpy arrays; needs an mpi4py communicator), or "auto":
            nvshmem when this process sees a GPU, else host. Every rank must make the same choice
            (checked).
        timeout: default seconds for bounded waits (else ``$MOECOMM_TIMEOUT_S``, else 10).
    """
    if transport not in TRANSPORTS:
        raise InvalidArgument(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    boot = bootstrap_of(comm)
    gpus = gpu_count()
    if transport == "auto":
        transport = "nvshmem" if gpus > 0 else "host"
    if transport == "nvshmem" and gpus == 0:
        raise MoeCommError("transport 'nvshmem' needs a GPU and this process sees none")
    chosen = [b.decode() for b in boot.allgather(transport.encode())]
    if len(set(chosen)) != 1:
        raise InvalidArgument(f"ranks chose different transports: {chosen}")
    if transport == "host" and getattr(boot, "mpi", None) is None:
        raise InvalidArgument("the host transport moves data over MPI: pass an mpi4py communicator")
    return Communicator(boot, transport, timeout)

