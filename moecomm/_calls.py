"""The call-order rules of one AllToAll on one rank, in one place.

A *call* is a dispatch followed by its combine. Each phase runs as its two halves at once or as a send half
and later its receive half, so a call issues the four halves of :data:`moecomm._constants.HALVES` in order,
each exactly once on every rank: that is what keeps the ranks' kernels and exchanges paired, and what numbers
the calls alike on every rank. A half a rank cannot run with data is still issued with no data
(``AllToAllBackend.skip``), flagged so that the peers raise for that call, so the pairing holds after any
error. The rule, the same for every transport (moecomm.AllToAll applies it):

* a refused request (an argument, or the order of halves) ends the call it belongs to: the call in progress
  (its remaining halves), or else the next call (all four halves);
* a dispatch that finds a call in progress (an error of the application between the halves, say) ends it
  first, then runs as the next call; :meth:`moecomm.AllToAll.abort` ends one on purpose;
* an error the transport raises on every rank in an exchange ends the call there (host), and one the kernels
  recorded ends it once it is raised (GPUs: at the end of the call, or by synchronize(), which issues the
  rest of the call with no data).
"""
from ._constants import HALVES
from ._errors import InvalidArgument

_PHASE_START = {"dispatch": 0, "combine": 2}  # the position in HALVES of each phase's send half
_HALVES = len(HALVES)


class CallOrder:
    """How far this rank is in the current call, and what the call's send halves were given.

    Attributes:
        number: calls started since construction or the last :meth:`restart` (a call starts with its
            dispatch send half, with data or without); the call number the kernels record in their error words.
        done: halves of the current call issued so far (0 between calls; they are issued in HALVES order).
        dispatch_weights: whether the current call's dispatch send carried router weights.
        dispatch_outputs: addresses of the output arrays its dispatch send half was given.
        combine_weights: whether its combine send half was given weights.
    """

    def __init__(self):
        self.restart()

    def restart(self):
        """Forget every call: the call sequence starts over (AllToAll.mask_ranks resets the device's too)."""
        self.number = 0
        self.end()

    def end(self):
        """The current call is over (its remaining halves are not issued, or were issued with no data)."""
        self.done = 0
        self.dispatch_weights = self.dispatch_outputs = self.combine_weights = None

    @property
    def open(self):
        """Whether a call is in progress (started, not all four halves issued)."""
        return self.done > 0

    def remaining(self):
        """The halves of the current call not yet issued, in order (empty between calls)."""
        return HALVES[self.done:] if self.done else ()

    def posted(self, phase):
        """Whether ``phase``'s send half was issued and its receive half not yet."""
        return self.done == _PHASE_START[phase] + 1

    def check(self, phase, send, recv):
        """Raise InvalidArgument when issuing ``phase``'s send and/or receive half now breaks the order (a
        dispatch send half always finds no call in progress: AllToAll ends a call left open first)."""
        posted = self.posted(phase)
        if send and posted:
            raise InvalidArgument(f"{phase}: a send is already posted; call {phase}(do_send=False) first")
        if recv and not send and not posted:
            raise InvalidArgument(f"{phase}: do_recv without a prior do_send")
        if phase == "combine" and send:
            if not self.done:
                raise InvalidArgument("combine: no dispatch to combine (each dispatch is followed by exactly one "
                                      "combine)")
            if self.done == 1:
                raise InvalidArgument("combine: the dispatch's receive half has not run yet")

    def advance(self, phase, send, recv, weights=False, outputs=None):
        """:meth:`check`, then record ``phase``'s halves as issued (a dispatch send half starts a new call) and
        what its send half was given: router weights or not, and (dispatch) the output arrays' addresses."""
        if send and recv:  # a whole phase in its place, the common case: what check() and the rest come to
            if phase == "dispatch" and not self.done:
                self.number += 1
                self.dispatch_weights, self.dispatch_outputs, self.done = weights, outputs, 2
                return
            if phase == "combine" and self.done == 2:
                self.end()
                return
        self.check(phase, send, recv)
        if send:
            if phase == "dispatch":
                self.number += 1
                self.dispatch_weights, self.dispatch_outputs = weights, outputs
            else:
                self.combine_weights = weights
            self.done = _PHASE_START[phase] + send + recv
        else:
            self.done += 1
        if self.done == _HALVES:
            self.end()

    def skipped(self, halves):
        """``halves`` (the rest of the current call, or a whole call from its dispatch send) were issued with no
        data: the call is over."""
        if halves and halves[0] == HALVES[0]:
            self.number += 1
        self.end()
