"""The transport boundary: what a new transport implements.

A transport moves bytes between the ranks of one communicator. :class:`moecomm.AllToAll` reads and
checks every argument in Python (dtype, shape, contiguity, device, the order of split halves) and then
calls a backend made by :meth:`Transport.new_alltoall`, so a backend never sees bad input.

Arguments reach a backend as the *call record* of their phase (one for dispatch, one for combine, made
once by ``backend.records()`` and kept by the backend), which AllToAll fills before each call of the phase
(a call given the same DeviceBuffers as the phase's last finds it as that call left it) with the fields of
:data:`moecomm._abi.CALL_FIELDS`, then hands it to ``dispatch(record, ...)`` / ``combine(record, ...)``, which
read it:
``x``, ``x_scale``, ``indices``, ``weights``, ``bound_m``, ``out_num``, ``out_x``, ``out_scale``,
``out_offsets`` (dispatch), ``indices``, ``weights``, ``bound_m``, ``y``, ``out_tokens``, ``out_dropped``
(combine), and the ints ``rows`` (the fewest rows of the call's per-token arrays), ``idx64``, ``partials``,
``zero_tail`` (combine: rows m..rows-1 of ``out_tokens`` are written as zeros too), ``nan_failed`` (combine,
GPUs: every row of ``out_tokens`` is NaN where the call failed).
A transport with ``memory == "host"`` gets numpy arrays (None where absent); one with ``memory == "device"``
gets device addresses (0 where absent) in a :class:`moecomm._abi.Call` structure that it hands to its
kernels as is.

A GPU transport is two files and two registry entries (the ``ipc`` transport is the example to copy, ~150
lines in all):

1. a device header ``cuda/transport_<name>.cuh`` with the operations the kernels use to reach peers
   (``signal_set``, ``word_set``, ``put_block``, ``put_signal_warp``, ``quiet``: ``cuda/transport.cuh`` states
   their meaning);
2. a subclass of :class:`moecomm.transport.gpu.GpuTransport` (``moecomm/transport/<name>.py``) providing the
   device runtime: bring-up over the bootstrap (``_start_runtime``, bounded), what the runtime must know
   of the loaded module (``_load_module``), symmetric allocation at the same offset on every rank
   (``symmetric``/``free``, collective), a peer's copy (``peer_array``), the peer table the kernels reach
   peers through (``peer_offsets``), teardown (``_stop_runtime``);
3. its build in :data:`moecomm._jit.VARIANTS` (the header, whether it puts) and its class in
   :data:`moecomm.transport.GPU_TRANSPORTS` (which makes ``moecomm.init(transport="<name>")`` start it).

Everything else is shared (moecomm/transport/gpu.py, gpu_alltoall.py): device arrays arrive as addresses
in the call record; work is ordered on the caller's stream and the host never synchronizes in dispatch or
combine; kernels report errors (timeouts naming the peer, refusals, routing) in an error word read
without synchronizing; a send half may already write this rank's own outputs; moecomm's barriers are
bounded host barriers over the bootstrap, the benchmark's device barrier is the peer-check kernel.

The call contract, the same on every transport: each dispatch is followed by exactly one combine, and
every rank issues each of a call's four halves (:data:`moecomm._constants.HALVES`) once; a half a rank
cannot run with data (its arguments were refused, or the call failed part-way) is issued with no data
(:meth:`AllToAllBackend.skip`), so the ranks' calls always pair up; a call that raises a non-fatal error
(refusal, bad routing) is over on every rank. A host transport raises the peers' errors in the call itself;
a device transport never synchronizes, so its kernels record them and the backend raises them once the call
is over on this rank (after issuing combine's receive half) or in ``synchronize``, and raises a timeout at
the next call.
"""
import abc
from types import SimpleNamespace

import numpy as np

from .._abi import CALL_FIELDS
from .._constants import BYTE_FIELDS, CALL_PHASES, COUNTER_FIELDS, GAP_EDGES


def host_call_records():
    """The call records of a host transport's AllToAll: ``{phase: record}``, each with every field of
    CALL_FIELDS, None (or 0 for the ints)."""
    return {phase: SimpleNamespace(**{f: (0 if t == "int" else None) for f, t in CALL_FIELDS},
                                   expert_w=None, out_w=None)  # the ranks layout's side rows (combine)
            for phase in CALL_PHASES}


def first_send(halves):
    """The first send half among ``halves`` (the one that tells the peers why a rank skips), or None."""
    return next((h for h in halves if h.endswith("_send")), None)


class AllToAllBackend(abc.ABC):
    """One AllToAll's transport-side state: buffers sized at construction, reused by every call."""

    @abc.abstractmethod
    def records(self):
        """``{"dispatch": record, "combine": record}``, the backend's call records (see the module doc), made
        once: AllToAll fills a phase's before each of its calls."""

    @abc.abstractmethod
    def dispatch(self, record, do_send: bool, do_recv: bool, stream, sources=None) -> None:
        """Send (``do_send``) and/or receive and unpack (``do_recv``) the dispatch arrays of ``record`` (this
        backend's dispatch record, filled for this call), on ``stream`` (device transports; None on the host).
        ``sources``: None, or (src_info, layout_range, add_counts) as :meth:`write_sources` takes them, written
        once the receive half has run (``do_recv`` is then True). Collective."""

    @abc.abstractmethod
    def combine(self, record, do_send: bool, do_recv: bool, stream) -> None:
        """Send expert outputs back and/or receive and sum them (the arrays of ``record``, the combine record),
        on ``stream``. Collective."""

    @abc.abstractmethod
    def skip(self, halves: tuple, stream, refusal=None) -> None:
        """Take part, with no data, in ``halves`` (names of :data:`moecomm._constants.HALVES`, in order) of
        the current call. With a ``refusal`` (:class:`moecomm.alltoall.Refusal`: text and code), the first
        send half among them tells the peers why, so that they raise (PeerError naming this rank, unless they
        recorded an error of that call already); ``stream`` is the call's, or None (then the device's
        current one)."""

    @abc.abstractmethod
    def set_mask(self, masked: tuple, generation: int, barrier) -> None:
        """Mask ``masked`` (ranks: no data to or from them, no wait for them) from the next call on, and
        restart the call sequence: finish this rank's work in flight, ``barrier()`` (among the unmasked
        ranks, bounded), reset, ``barrier()``. ``generation`` numbers the restarts of this AllToAll, the same
        on every rank taking part (a rank that was masked may have missed some): messages may carry it."""

    @abc.abstractmethod
    def snapshot(self) -> dict:
        """This rank's telemetry since construction, from :func:`snapshot`."""

    def set_expert_map(self, expert_map) -> None:
        """Route logical expert ids through ``expert_map`` (a :class:`moecomm.balance.ExpertMap`) from the next
        dispatch on, and carry its generation in every call (AllToAll with ``slots_per_rank``; AllToAll has
        checked that every rank passes the same map). A transport that cannot says so."""
        from .._errors import InvalidArgument
        raise InvalidArgument(f"{type(self).__name__} does not take expert maps")

    def write_sources(self, src_info, layout_range, add_counts, stream) -> None:
        """Write where the last dispatch received (before its combine) put each source rank's rows, in the
        padded layout with each expert's slots grouped by source (AllToAllConfig.slots_by_source):
        ``src_info`` [num_local_experts, capacity] int32, each slot's token (-1: empty); ``layout_range``
        [num_local_experts, world_size] int64, (first slot << 32) | slots of each source rank (0: none);
        ``add_counts`` [num_local_experts] int32 or absent: each expert's slots written added to it."""
        raise NotImplementedError

    def write_row_routing(self, indices, idx64, weights, stream) -> None:
        """Write the ranks layout's routing of each row the last dispatch received (before its combine):
        ``indices`` [capacity, top-k] int32/int64 (``idx64``: 1 for int64), local expert ids (-1: another rank's,
        or none; every row past the received ones); ``weights`` [capacity, top-k] float32 or None, the dispatched
        weights there (0 elsewhere). The transports that take the ranks layout implement it."""
        raise NotImplementedError

    # Gradients along a routing plan (AllToAll.plan, dispatch_backward, combine_backward), where ``gradients``
    # is True; AllToAll refuses them elsewhere (on every rank alike: the configuration is the same everywhere).
    # ``stream``: the call's launch stream (None on the host).
    gradients = False

    def write_plan(self, plan, stream) -> None:
        """Write the routing plan of the last dispatch received (before its combine) into ``plan`` (a
        RoutingPlan of arrays as read): ``expert`` [max_num_tokens, k] int32, the physical expert of each
        (token, k) pair this rank sent (-1: none); ``origin`` [out_expert_x's shape but the last, 3] int32,
        (source rank, token, k) of each slot (-1: empty); ``call`` [2] int32, (restart generation, dispatch
        number), the same on every rank; ``held`` [1 + slots] int32, how many slots hold a pair and which;
        ``local`` [max_num_tokens, k] int32, the slot of each pair this rank sent to its own experts (-1:
        none). Not collective."""
        raise NotImplementedError

    def dispatch_backward(self, args, stream) -> None:
        """``args.out[:m]`` = each token's summed gradient from the slots ``args.origin`` gives it
        (``args.grad``: the slots' gradients), on every rank of its DP group. Collective."""
        raise NotImplementedError

    def combine_backward(self, args, stream) -> None:
        """``args.out_grad_y`` = weight * gradient of each slot's token (zeros where empty),
        ``args.out_grad_weights[:m]`` = <gradient, ``args.y`` of the pair's slot> per pair. Collective."""
        raise NotImplementedError

    def skip_backward(self, phase, refusal, stream) -> None:
        """Take part with no data in a backward ``phase`` ("dispatch_backward" or "combine_backward") whose
        arguments this rank refused, telling the peers why."""
        raise NotImplementedError

    def synchronize(self, stream) -> None:
        """Wait for this AllToAll's work on ``stream``; raise errors the device recorded. Not collective."""

    def check_error(self) -> None:
        """Raise an error the device recorded and no call has raised (no synchronization). Not collective."""

    # A device transport issues the calls into a CUDA graph being recorded while ``captured`` is True (set
    # by AllToAll.captured(recording=True)): then it raises nothing the device recorded (the graph's replays run
    # without it).
    captured = False

    @abc.abstractmethod
    def destroy(self, collective: bool) -> None:
        """Release buffers; called at most once. Collective, unless ``collective`` is False (the
        communicator is broken): then release only what needs no peer."""


class Transport(abc.ABC):
    """A communicator's data path. ``name`` and ``memory`` ("host" or "device") are class attributes.

    Attributes:
        device: CUDA device ordinal for device transports (-1 for host transports).
        context: the :class:`moecomm._cuda.Context` entry points make current (None for host transports).
    """
    name = ""
    memory = ""
    device = -1
    context = None

    @abc.abstractmethod
    def new_alltoall(self, cfg, timeout_s, ident) -> AllToAllBackend:
        """Create the backend for one AllToAll configuration (collective; its telemetry as ``cfg.telemetry``
        says, see :func:`snapshot`). ``ident`` is the AllToAll's number on the communicator, the same on every
        rank (messages may carry it)."""

    @abc.abstractmethod
    def new_arrays(self, max_rows):
        """An argument reader for one AllToAll whose per-token arrays have at most ``max_rows`` rows (it holds
        per-call state: moecomm._arrays)."""

    @abc.abstractmethod
    def check_peers(self, nbytes: int, timeout_s: float) -> None:
        """Exchange ``nbytes`` with every rank and verify them; raise on loss, corruption or timeout."""

    @abc.abstractmethod
    def finalize(self, collective: bool) -> None:
        """Release everything the transport holds. Collective (bounded by the communicator's timeout),
        unless ``collective`` is False (the communicator is broken): then release only what needs no peer."""

    def leave(self, drain=False) -> None:
        """This rank is leaving (Communicator.finalize, or its program ends on an error): tell the peers
        through the transport where waits of theirs do not watch the bootstrap (their kernels); with ``drain``,
        once this rank's own work has run (what it sends reaches them first)."""


def snapshot(counters, received, dropped, bytes_by_peer, ring, times_us=None, plan=None, tag_ring=None,
             gap_ring=None):
    """A backend's telemetry as AllToAll.stats() returns it (L local experts, W ranks):

    ``MASKED_PAIRS``, ``DROPPED_PAIRS``, ``CALLS`` (ints, moecomm._constants.COUNTER_FIELDS); ``received`` [L]
    tokens received per local expert (kept pairs), ``dropped`` [L] pairs dropped for capacity per local
    expert; ``bytes`` {BYTE_FIELDS name: [W] bytes per peer}; ``window`` [min(CALLS, window), L] the pairs
    routed to each local expert (its demand, dropped ones included) in each of the last calls, oldest first;
    ``times_us`` {"dispatch", "combine": [microseconds per call]} (timing=True) or None; ``plan`` what a GPU
    backend launches (moecomm.transport.gpu_plan.LaunchPlan.summary()), None on the host; ``by_tag``
    [min(CALLS, window), num_tags, L] the pairs each local expert received per tag in each of those calls
    (num_tags; else None); ``score_gap`` {"edges": GAP_EDGES, "counts": [min(CALLS, window), GAP_BINS]} this
    rank's tokens per router-confidence bin in each of those calls (score_gap; else None).

    Args: ``counters`` [COUNTER_FIELDS], ``received``/``dropped`` [L], ``bytes_by_peer`` [BYTE_FIELDS, W],
    ``ring`` [window, L] with the row of call c (from 0) at c % window (window 0: telemetry off, only the
    counters are kept), ``tag_ring`` [window, num_tags, L] and ``gap_ring`` [window, GAP_BINS] rowed alike (or
    None); ``times_us`` as above.
    """
    out = {name: int(v) for name, v in zip(COUNTER_FIELDS, counters)}
    calls, n = out["CALLS"], ring.shape[0]
    rows = np.arange(max(0, calls - n), calls) % max(n, 1)
    out.update(received=np.asarray(received, np.int64), dropped=np.asarray(dropped, np.int64),
               bytes={name: np.asarray(b, np.int64) for name, b in zip(BYTE_FIELDS, bytes_by_peer)},
               window=np.asarray(ring, np.int64)[rows], times_us=times_us, plan=plan,
               by_tag=None if tag_ring is None else np.asarray(tag_ring, np.int64)[rows],
               score_gap=None if gap_ring is None else {"edges": list(GAP_EDGES),
                                                         "counts": np.asarray(gap_ring, np.int64)[rows]})
    return out


def peer_pattern(src, dst, nbytes):
    """The bytes rank ``src`` sends rank ``dst`` in a peer check (uint8, broadcast over src/dst, then nbytes)."""
    i = np.arange(nbytes, dtype=np.int64)
    return ((np.asarray(src)[..., None] * 131 + np.asarray(dst)[..., None] * 17 + i * 7) & 0xFF).astype(np.uint8)
