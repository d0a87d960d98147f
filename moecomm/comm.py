"""Bootstrap: ``moecomm.init()`` turns the program's process group into a :class:`Communicator`.

moecomm needs little from the launcher: ranks that can gather bytes from each other and wait for each
other. That is the :class:`Bootstrap` interface; mpi4py communicators (the default) and
``torch.distributed`` process groups are adapted to it here, and a JAX or custom runtime can implement
it in a few lines. The GPU transport needs nothing else; the host transport moves its data over MPI and
so needs an mpi4py communicator.
"""
import abc
import atexit
import contextlib
import functools
import importlib
import logging
import os
import pickle
import socket
import sys
import threading
import time

from ._constants import timeout_seconds
from ._errors import CommBroken, CommTimeout, ConcurrentCall, InvalidArgument, MoeCommError, OutOfStep, PeerExited
from .transport import GPU_TRANSPORTS

log = logging.getLogger("moecomm")

TRANSPORTS = ("auto", "host", *GPU_TRANSPORTS)
TRANSPORT_ENV = "MOECOMM_TRANSPORT"  # what "auto" means when set
_POLL_S = 1e-3  # how often finalize looks for the peers' departures
FINALIZE = "finalize"  # the departure reason of a rank that finalizes (it takes part in the teardown)
BROKE = "its communicator broke"  # the start of the reason of a rank that leaves with a broken communicator (an
                                  # earlier failure, which it raised itself: its finalize is local)
FAILED = "it raised"  # the start of the reason of a rank whose program ended on an exception it did not handle
_REASON_CHARS = 400  # of a departure's reason, at most


class Bootstrap(abc.ABC):
    """The process group moecomm starts from. Implement it to start moecomm from any runtime.

    Attributes:
        rank: this process's rank, 0 <= rank < world_size.
        world_size: number of processes.
    """
    rank = 0
    world_size = 1
    announces = False  # whether leave() reaches the peers (then finalize waits for their notices)

    @abc.abstractmethod
    def allgather(self, data: bytes, timeout_s: float, what: str) -> list:
        """Collective: every rank passes ``data`` (bytes); returns the list of every rank's bytes, by rank.

        Should raise :class:`moecomm.CommTimeout` (naming a silent rank in ``.peer`` when it can) when not
        every rank has taken part within ``timeout_s`` seconds. ``what`` names the operation, for errors.
        """

    def barrier(self, timeout_s: float, what: str) -> None:
        """Collective: return once every rank has called it (bounded like :meth:`allgather`)."""
        self.allgather(b"", timeout_s, what)

    def subset_allgather(self, data: bytes, ranks: list, timeout_s: float, what: str) -> list:
        """Like :meth:`allgather` among ``ranks`` only (sorted, this rank among them); the other ranks may be
        dead. Needed by ``AllToAll.mask_ranks``; a bootstrap that cannot leaves it out."""
        raise MoeCommError(f"{what}: the {type(self).__name__} bootstrap cannot gather among a subset of ranks "
                           f"(mask_ranks needs an MPI bootstrap)")

    def leave(self, reason: str) -> None:
        """Tell every other rank, without waiting, that this one is leaving and why (its process is ending:
        finalize, or an exception it did not handle). A bootstrap that cannot leaves it out: the peers then
        learn of it from their timeouts."""

    def departed(self, ranks) -> dict:
        """{rank: reason} of the ``ranks`` that have said they are leaving (:meth:`leave`); never waits."""
        return {}

    def close(self, collective: bool) -> None:
        """Release what the bootstrap holds (finalize, after the transport; ``collective``: every rank takes
        part, the communicator was not broken)."""


class MpiBootstrap(Bootstrap):
    """An mpi4py communicator (``mpi`` attribute: the communicator itself; init() gives it a duplicate of the
    one passed, :func:`moecomm._mpi.duplicate`). Its control collectives are point to point with deadlines
    (:class:`moecomm._mpi.Control`): a silent rank is named."""

    announces = True

    def __init__(self, mpi, owned=False):
        from ._mpi import Control
        self.mpi, self._control, self.owned = mpi, Control(mpi), owned  # owned: a duplicate, freed by close()
        self.rank, self.world_size = mpi.Get_rank(), mpi.Get_size()

    def allgather(self, data, timeout_s, what):
        return self._control.allgather(data, what, timeout_s)

    def subset_allgather(self, data, ranks, timeout_s, what):
        return self._control.allgather(data, what, timeout_s, ranks)

    @property
    def departures(self):
        """The :class:`moecomm._mpi.Departures` of this communicator (the host transport's waits watch it)."""
        return self._control.departures

    def leave(self, reason):
        self.departures.leave(reason)

    def departed(self, ranks):
        return self.departures.seen(ranks)

    def close(self, collective):
        if self.owned and collective:  # a broken one is left to MPI's end (a dead peer may hold its messages)
            self.mpi.Free()


class TorchBootstrap(Bootstrap):
    """A ``torch.distributed`` process group (e.g. under torchrun). Its collectives are bounded by the
    group's own timeout (``init_process_group(timeout=...)``), not by moecomm's. With the NCCL backend,
    torch's current device must be this rank's GPU (``torch.cuda.set_device``), as torch.distributed
    itself requires."""

    def __init__(self, group):
        import torch.distributed as dist
        self._dist, self.group = dist, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    def allgather(self, data, timeout_s, what):
        out = [None] * self.world_size
        self._dist.all_gather_object(out, bytes(data), group=self.group)
        return out

    def barrier(self, timeout_s, what):
        self._dist.barrier(group=self.group)


def bootstrap_of(comm, timeout_s):
    """The Bootstrap for ``comm``: None (MPI.COMM_WORLD), an mpi4py communicator (moecomm works on a
    duplicate of it: :func:`moecomm._mpi.duplicate`), a torch.distributed process group, or a Bootstrap.
    Collective for an mpi4py communicator, bounded by ``timeout_s``."""
    if isinstance(comm, Bootstrap):
        return comm
    if comm is None:
        comm = _mpi().COMM_WORLD
    module = type(comm).__module__
    if module.startswith("mpi4py"):
        from ._mpi import duplicate
        return MpiBootstrap(duplicate(comm, timeout_s), owned=True)
    if module.startswith("torch"):
        return TorchBootstrap(comm)
    raise InvalidArgument(f"comm: expected an mpi4py communicator, a torch.distributed process group or a "
                          f"moecomm.Bootstrap, got {type(comm).__name__}")


class OneCall:
    """One call at a time on a communicator (its ``calls``): entered by every call that exchanges, launches or
    changes a call's state (moecomm's own calls within one enter again); a thread that enters while another
    thread is inside raises :class:`moecomm.ConcurrentCall` at once, before anything of its call is done."""

    def __init__(self, rank):
        self.rank, self.lock = rank, threading.RLock()

    def refused(self):
        return ConcurrentCall(f"rank {self.rank}: another thread of this rank is inside a call on this communicator "
                              f"(moecomm takes one call at a time per communicator): this call was refused before "
                              f"it began, the other goes on; its peers wait for this rank's part as for a late rank "
                              f"(make it again, or make every call from one thread)")

    def __enter__(self):
        if not self.lock.acquire(False):
            raise self.refused()
        return self

    def __exit__(self, *exc):
        self.lock.release()


def one_call(method):
    """Decorator of a method of an object with a ``comm`` (a Communicator): the method is a call, entered
    through the communicator's :class:`OneCall` (its lock taken directly: the hot path of every call)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        calls = self.comm.calls
        if not calls.lock.acquire(False):
            raise calls.refused()
        try:
            return method(self, *args, **kwargs)
        finally:
            calls.lock.release()
    return call


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

    Every wait of a communicator is bounded by its timeout and raises :class:`moecomm.CommTimeout`
    naming a silent rank. After a timeout (or calls gone out of step across ranks) the communicator is
    *broken*: every later call raises :class:`moecomm.CommBroken` at once, ``finalize()`` and interpreter
    exit skip the collective teardown, and at exit the process ends without finalizing MPI (which would
    wait for the dead rank forever): with status 1 if an exception went unhandled, else 0.

    Attributes:
        bootstrap: the :class:`Bootstrap` it was started from.
        mpi: the mpi4py communicator moecomm uses (a duplicate of the one given to init), or None when started
            from another runtime.
        rank, world_size: this process's rank and the number of ranks.
        local_rank, local_size: rank and count among the ranks sharing this node.
        transport: the :class:`moecomm.transport.Transport` in use (``.name``: "host", "nvshmem" or "ipc").
        device: CUDA device ordinal bound to this rank, or -1 on the host transport.
        timeout_s: seconds any wait may last (the default for every AllToAll).
        broken: why the communicator can no longer be used, or None.
    """

    def __init__(self, bootstrap, transport_name, timeout_s, device=None):
        self.bootstrap, self.timeout_s, self.broken, self.transport = bootstrap, timeout_s, None, None
        self._alltoalls = 0  # AllToAlls constructed (each one's number: messages carry it)
        self._live_alltoalls = []  # those not destroyed, in construction order (held: a dropped one may have
                                   # exchanges in flight, whose buffers must outlive them)
        self.breaks = 0  # times fail() was called (an AllToAll resynchronized since the last one may serve)
        self.mpi = getattr(bootstrap, "mpi", None)
        self.rank, self.world_size = bootstrap.rank, bootstrap.world_size
        self.calls = OneCall(self.rank)  # one thread's call at a time
        nodes = self._allgather(_node_id(), "init")
        here = [r for r, n in enumerate(nodes) if n == nodes[self.rank]]
        self.local_rank, self.local_size = here.index(self.rank), len(here)
        if transport_name == "gpu":  # "auto" on GPUs: ipc when every rank is on this node, else nvshmem
            transport_name = "ipc" if self.local_size == self.world_size else "nvshmem"
        log.info("moecomm rank %d/%d: transport %s, timeout %.3g s", self.rank, self.world_size, transport_name,
                 timeout_s)
        with self.breaking():
            if transport_name == "host":
                from .transport.host import HostTransport
                self.transport = HostTransport(self.mpi, bootstrap.departures)
            else:
                module, cls = GPU_TRANSPORTS[transport_name]
                transport = getattr(importlib.import_module(f".transport.{module}", __package__), cls)
                self.transport = transport(bootstrap, self.local_rank, self.local_size, timeout_s, device)
        self.device = self.transport.device
        _exit_guard.watch(self)

    def allgather(self, obj, what="allgather"):
        """Gather one picklable object from every rank (collective, bounded by the timeout)."""
        self.check_live()
        return self._allgather(obj, what)

    def _allgather(self, obj, what):
        with self.calls, self.breaking():
            return [pickle.loads(b) for b in self.bootstrap.allgather(pickle.dumps(obj), self.timeout_s, what)]

    def gather_among(self, obj, ranks, what):
        """Gather one picklable object from each of ``ranks`` (bounded; works on a broken communicator: the
        other ranks may be dead). For AllToAll.mask_ranks."""
        if self.transport is None:
            raise InvalidArgument("this Communicator was finalized")
        with self.calls, self.breaking():
            data = self.bootstrap.subset_allgather(pickle.dumps(obj), ranks, self.timeout_s, what)
        return [pickle.loads(b) for b in data]

    def barrier(self):
        """Wait for every rank (collective, bounded by the timeout)."""
        self.check_live()
        with self.calls, self.breaking():
            self.bootstrap.barrier(self.timeout_s, "barrier")

    def check_peers(self, nbytes=4096, timeout=None):
        """Send ``nbytes`` to every rank through the transport and verify what arrives (collective).

        On GPUs this launches the peer-check kernel (NVSHMEM put with signal, bounded wait). Raises
        CommTimeout naming a silent peer, MoeCommError on wrong bytes.
        """
        self.check_live()
        if int(nbytes) <= 0:
            raise InvalidArgument(f"nbytes must be > 0, got {nbytes}")
        t = self.timeout_s if timeout is None else timeout_seconds(timeout)[0]
        with self.calls, self.breaking():
            self.transport.check_peers(int(nbytes), t)

    def symmetric(self, shape, dtype):
        """A CuPy array in the GPU transport's symmetric memory (the NVSHMEM heap, or the ipc heap):
        collective, same shapes, same order on all ranks.

        Contents are undefined. ``dtype`` must be one CuPy supports (uint8/uint16 for fp8/bf16 data).
        GPU transports only; free with :meth:`free` (collective) or at :meth:`finalize`.
        """
        with self.calls:
            return self._gpu("symmetric").symmetric(shape, dtype)

    def peer_array(self, array, pe):
        """Rank ``pe``'s copy of a symmetric ``array``, mapped for loads/stores over NVLink, or None when
        that rank is not load/store reachable (another node). GPU transport only."""
        return self._gpu("peer_array").peer_array(array, pe)

    def free(self, array):
        """Free an array from :meth:`symmetric` (collective, same order on every rank). GPU transport only."""
        with self.calls:
            self._gpu("free").free(array)

    def _gpu(self, what):
        self.check_live()
        if self.transport.memory != "device":
            raise InvalidArgument(f"{what}: symmetric memory needs a GPU transport (nvshmem or ipc), this "
                                  f"communicator uses {self.transport.name!r}")
        return self.transport

    # what moecomm.AllToAll uses ----------------------------------------------------------------
    def register(self, alltoall):
        """Count a new AllToAll (finalize destroys it if it is still alive); returns its number on this
        communicator, the same on every rank (construction is collective and in the same order everywhere)."""
        self._alltoalls += 1
        self._live_alltoalls.append(alltoall)
        return self._alltoalls

    def unregister(self, alltoall):
        """A destroyed AllToAll."""
        self._live_alltoalls = [a for a in self._live_alltoalls if a is not alltoall]

    def check_live(self):
        """Raise unless the communicator can be used: finalized (InvalidArgument), broken (CommBroken)."""
        if self.transport is None:
            raise InvalidArgument("this Communicator was finalized")
        if self.broken is not None:
            raise CommBroken(f"this Communicator is broken ({self.broken}); finalize it and start a new one")

    @contextlib.contextmanager
    def breaking(self):
        """Mark the communicator broken when what runs inside raises CommTimeout (PeerExited included) or
        finds the ranks out of step (messages of that call may still be in flight)."""
        try:
            yield
        except (CommTimeout, OutOfStep) as e:
            self.fail(e)
            raise

    def fail(self, error):
        """Mark the communicator broken by ``error`` (the first reason is kept)."""
        self.breaks += 1
        if self.broken is None:
            self.broken = f"{type(error).__name__}: {error}"
            _exit_guard.broken = True
            log.error("moecomm rank %d: communicator broken: %s", self.rank, self.broken)

    def finalize(self):
        """Destroy the AllToAlls still alive (later calls of theirs raise InvalidArgument), then release the
        transport (NVSHMEM included). Collective: every rank says it is leaving and waits, bounded, until
        every other rank has said so too, so that a rank still running is named here (CommTimeout) rather
        than waited for at exit, and a rank still waiting for this one in a call is told (PeerExited); local
        only when the communicator is broken. A peer that left with its communicator broken (it raised what
        broke it) makes the teardown local without an error here; one whose program failed is named
        (PeerExited) after the local teardown. Safe to call twice."""
        if self.transport is None:
            return
        with self.calls:
            self._finalize()

    def _finalize(self):
        try:
            # a peer whose kernels still wait for this rank (it is in a call) stops waiting at once
            self.transport.leave(drain=self.broken is None)
            left = None
            for alltoall in list(self._live_alltoalls):
                try:
                    alltoall.destroy()
                except PeerExited as e:  # a peer left: the teardown is local from here (broken)
                    left = left or e
            if self.broken is None:
                self._leave_together()
            else:  # a peer still waiting in a call with this rank is told (it raises PeerExited)
                self.bootstrap.leave(f"{BROKE} ({self.broken})"[:_REASON_CHARS])
            if left is not None and left.reason.startswith(FAILED):
                raise left  # its program failed
        finally:
            _exit_guard.forget(self)
            t, self.transport = self.transport, None
            with self.breaking():
                t.finalize(collective=self.broken is None)
            self.bootstrap.close(collective=self.broken is None)

    def _leave_together(self):
        """Tell every rank this one leaves, then wait (bounded) until every other rank has told this one (a
        bootstrap without notices: a barrier). A rank that left after an error makes the teardown local."""
        if not self.bootstrap.announces:
            with self.breaking():
                self.bootstrap.barrier(self.timeout_s, "finalize")
            return
        self.bootstrap.leave(FINALIZE)
        others = [q for q in range(self.world_size) if q != self.rank]
        deadline = time.monotonic() + self.timeout_s
        while len(gone := self.bootstrap.departed(others)) < len(others):
            if time.monotonic() > deadline:
                still = sorted(set(others) - set(gone))
                error = CommTimeout(f"finalize: rank(s) {still} did not finalize within {self.timeout_s:g} s (still "
                                    f"running; they were told that this rank left)", peer=still[0], phase="finalize")
                self.fail(error)
                raise error
            time.sleep(_POLL_S)
        local = {q: why for q, why in gone.items() if why != FINALIZE}
        if local:  # they take no part in the teardown, which is then local
            q = min(local)
            error = PeerExited(f"finalize: rank {q} left the job ({local[q]})", peer=q, phase="finalize",
                               reason=local[q])
            self.fail(error)
            if any(why.startswith(FAILED) for why in local.values()):  # a program failed: said here too (a rank
                raise error                                             # whose communicator broke raised that itself)

    def abandon(self, reason):
        """Leave without waiting for anyone (the process is ending after an error): the peers are told, with
        ``reason``, and raise PeerExited naming this rank; nothing collective follows."""
        if self.transport is None:
            return
        self.bootstrap.leave(reason)
        self.transport.leave()
        self.fail(MoeCommError(f"this rank left ({reason})"))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.finalize()


class _ExitGuard:
    """At interpreter exit: a rank ending on an exception it did not handle tells its peers (each live
    communicator's :meth:`Communicator.abandon`, with the exception) and ends without MPI's finalization;
    otherwise live communicators are finalized (collectively; a peer waiting for this rank in a call raises
    PeerExited at once). If a wait for a peer failed (in init or in a communicator), the process ends without
    MPI's finalization, which waits for every rank, dead ones included. It holds every communicator not
    finalized (a local of a function that returned too). Installed by the first init()."""

    def __init__(self):
        self.comms, self.unhandled, self.broken, self._previous_hook = [], None, False, None

    def install(self):
        if self._previous_hook is None:
            self._previous_hook = sys.excepthook
            sys.excepthook = self._excepthook
            atexit.register(self.at_exit)

    def watch(self, comm):
        self.comms.append(comm)

    def forget(self, comm):
        self.comms = [c for c in self.comms if c is not comm]

    def _excepthook(self, kind, value, tb):
        self.unhandled = f"{FAILED} {kind.__name__}: {value}"[:_REASON_CHARS]
        self._previous_hook(kind, value, tb)

    def at_exit(self):
        for comm in list(self.comms):
            try:
                if self.unhandled:
                    comm.abandon(self.unhandled)
                    self.broken = True
                else:
                    comm.finalize()
            except MoeCommError as e:
                log.error("moecomm rank %d: finalize at exit: %s", comm.rank, e)
        if self.broken:
            logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(1 if self.unhandled else 0)


_exit_guard = _ExitGuard()


def _mpi():
    from mpi4py import MPI
    return MPI


def init(comm=None, transport="auto", timeout=None, device=None):
    """Create a :class:`Communicator` (collective over ``comm``, bounded by the timeout).

    Args:
        comm: the process group: an mpi4py communicator (default ``MPI.COMM_WORLD``; moecomm works on its
            own duplicate, freed by finalize, so init() on the same communicator after finalize() starts
            clean even after a break), a ``torch.distributed`` process group (e.g.
            ``torch.distributed.group.WORLD`` under torchrun), or any :class:`Bootstrap`.
        transport: "nvshmem" (GPUs: binds GPU ``local_rank`` and starts NVSHMEM by a unique id gathered
            through ``comm``; any number of nodes), "ipc" (GPUs of one node: CUDA IPC, no NVSHMEM), "host"
            (CPU ranks, numpy arrays; needs an mpi4py communicator), or "auto": ``$MOECOMM_TRANSPORT`` when
            set, else on GPUs ipc when every rank is on one node and nvshmem otherwise, host when this
            process sees no GPU. Every rank must make the same choice (checked).
        device: the CUDA device of this rank (GPU transports), or None: the rank's index among the ranks of
            ``comm`` on its node (GPU 0 when the process sees one GPU). Give it when ``comm`` is a part of
            the job, e.g. data-parallel replicas each with its own communicator.
        timeout: seconds any wait may last (else ``$MOECOMM_TIMEOUT_S``, else 10); a rank silent for longer
            is named in a CommTimeout.
    """
    if transport not in TRANSPORTS:
        raise InvalidArgument(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if device is not None and (isinstance(device, bool) or not isinstance(device, int) or device < 0):
        raise InvalidArgument(f"device must be a CUDA device ordinal >= 0 or None, got {device!r}")
    timeout_s, source = timeout_seconds(timeout)
    _exit_guard.install()
    gpus = gpu_count()
    if transport == "auto" and os.environ.get(TRANSPORT_ENV):
        transport = os.environ[TRANSPORT_ENV]
        if transport not in TRANSPORTS:
            raise InvalidArgument(f"${TRANSPORT_ENV} must be one of {TRANSPORTS}, got {transport!r}")
    if transport == "auto":
        transport = "gpu" if gpus > 0 else "host"  # which GPU transport: once the nodes are known
    if transport in GPU_TRANSPORTS and gpus == 0:
        raise MoeCommError(f"transport {transport!r} needs a GPU and this process sees none")
    try:  # what every rank must choose alike
        boot = bootstrap_of(comm, timeout_s)
        chosen = [pickle.loads(b) for b in boot.allgather(pickle.dumps((transport, timeout_s)), timeout_s, "init")]
    except (CommTimeout, OutOfStep):
        _exit_guard.broken = True
        raise
    if len({t for t, _ in chosen}) != 1:
        raise InvalidArgument(f"ranks chose different transports: {[t for t, _ in chosen]}")
    if len({s for _, s in chosen}) != 1:
        raise InvalidArgument(f"ranks chose different timeouts (seconds, by rank): {[s for _, s in chosen]}")
    if transport == "host" and getattr(boot, "mpi", None) is None:
        raise InvalidArgument("the host transport moves data over MPI: pass an mpi4py communicator")
    log.info("moecomm rank %d/%d: timeout %.3g s (from %s)", boot.rank, boot.world_size, timeout_s, source)
    return Communicator(boot, transport, timeout_s, device)
