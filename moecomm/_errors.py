"""Exception types.

Two roots, as in nvshmem4py: :class:`InvalidArgument` for caller misuse, and :class:`MoeCommError` for
failures of the library, a peer or the device. Misuse found on the host is raised before anything of the call
is launched or sent; misuse only the kernels can see (a combine's bound_m against its dispatch's, expert ids
that differ between the halves) is recorded on the device and raised as InvalidArgument once the call is
over. Either way the call ends on every rank, nothing is corrupted and the next call works.
"""


# combine given other expert ids than its dispatch (refused on every transport: the rows it would sum are another
# routing's)
IDS_DIFFER = ("indices: the expert ids given to combine differ from those given to its dispatch (rows 0..m-1 "
              "must be the same)")


def weights_differ(peer, theirs, mine):
    """The message of ranks whose combines disagree on the router weights: rank ``peer``'s was given them
    (``theirs``), this rank's (``mine``), or the reverse."""
    def where(given):
        return "to combine" if given else "with dispatch only (combine's weights=None)"
    return (f"combine: rank {peer} gives the router weights {where(theirs)}, this rank {where(mine)}: every rank "
            f"must do the same (with weights=None the expert side sums each token's rows)")


class MoeCommError(RuntimeError):
    """A failure inside moecomm, the transport, a peer or the device."""


class InvalidArgument(ValueError):
    """A call was given something it cannot take; the message says what was expected."""


class InvalidRouting(MoeCommError):
    """Invalid routing input reached dispatch: an expert id outside ``[-1, num_experts)`` or repeated within
    one token, or a ``bound_m`` outside ``[0, min(rows, max_num_tokens)]`` (read on the device on GPUs).

    Raised on every rank of the group (on GPUs once the call is over, or by synchronize()); the faulty
    rank's tokens were not sent, the outputs of the call are unspecified, the next valid call is correct.
    """


class CommTimeout(MoeCommError):
    """A bounded wait for a peer expired.

    Attributes:
        peer: rank that did not answer (-1 if unknown).
        phase: name of the phase that was waiting (``"dispatch"``, ``"combine"``, ...).
    """

    def __init__(self, message, peer=-1, phase=""):
        super().__init__(message)
        self.peer = peer
        self.phase = phase


class PeerExited(CommTimeout):
    """A rank this one waited for has left the job: it finalized, or its program ended on an exception it
    did not handle, and it told its peers before going (a killed rank cannot: it is named by CommTimeout
    after the timeout). Raised within about a second on the ranks that wait for it; the communicator is
    broken, as after any CommTimeout.

    Attributes:
        peer: the rank that left; phase: what was waiting; reason: what that rank said ("finalize", or the
            exception it raised).
    """

    def __init__(self, message, peer=-1, phase="", reason=""):
        super().__init__(message, peer, phase)
        self.reason = reason


class PeerError(MoeCommError):
    """Another rank's part of a collective call failed (its reason is in the message): that rank sent
    nothing, the call is over and the next call works. Raised on the ranks whose own arguments were fine
    (on GPUs once the call is over, or by synchronize()), while the faulty rank raises InvalidArgument.

    Attributes:
        peer: rank whose call failed.
        reason: what that rank raised.
    """

    def __init__(self, message, peer=-1, reason=""):
        super().__init__(message)
        self.peer = peer
        self.reason = reason


class OutOfStep(MoeCommError):
    """Two ranks paired calls that do not belong together (another AllToAll, another phase, another call
    number, another control operation): raised on every rank involved instead of exchanging data."""


class ConcurrentCall(MoeCommError):
    """A call began on this rank while another thread of it was inside a call on the same communicator
    (moecomm takes one call at a time per communicator): refused at once, on this rank only. Nothing of it
    ran, the other thread's call goes on unharmed, and the communicator stays usable. Its peers, which made
    their part of the call, wait for this rank's as for any late rank: make the call again (after the other
    thread's), or make every call from one thread. Threads that take turns are fine (every rank must make
    its calls in the same order, as from one thread; ``call_id`` checks it)."""


class CapacityExceeded(MoeCommError):
    """More (token, expert) pairs went to an expert than its capacity (``AllToAll(capacity=..., overflow=
    "error")``): raised on every rank, naming the expert and its demand; nothing was exchanged and the next
    call works.

    Attributes:
        expert: the (physical) expert id, demand: pairs routed to it, capacity: its slots.
    """

    def __init__(self, message, expert=-1, demand=0, capacity=0):
        super().__init__(message)
        self.expert, self.demand, self.capacity = expert, demand, capacity


class ExpertMapMismatch(MoeCommError):
    """The ranks' calls carried different expert-map generations (``AllToAll.set_expert_map``): raised on
    every rank instead of routing a token to the wrong expert; nothing was exchanged and the next call with
    matching maps works."""


class CommBroken(MoeCommError):

    """The communicator can no longer be used: an earlier wait for a peer expired (or the ranks' calls went
    out of step), so messages of that call may still be in flight. Every later call raises this at once;
    ``finalize()`` and interpreter exit skip the collective teardown. Recover by finalizing and starting a
    new communicator among the ranks that are alive (a new job, or a new MPI communicator of survivors)."""


class CompileError(MoeCommError):
    """NVRTC or nvJitLink rejected a kernel; the message carries the compiler log."""

