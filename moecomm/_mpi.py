"""MPI with deadlines: every wait of moecomm on MPI is non-blocking and bounded, and names who is silent.

moecomm's messages travel on the caller's communicator under its own tags (``TAG_*`` below), point to
point, so that a rank that does not answer can be named (a collective would only say "someone").
"""
import time

from ._errors import CommTimeout, OutOfStep, PeerExited

TAG_CONTROL, TAG_SUBSET = 0x6C00, 0x6C01            # control collectives of the bootstrap: all ranks, a subset
TAG_LEAVE = 0x6C02                                   # a rank's departure notice (Departures)
TAG_INIT = 0x6C03                                    # a rank's arrival in init on the communicator it was given
TAG_PEER_CHECK = 0x6D20                              # host transport's peer check
TAG_EXCHANGE, PHASES, GENERATIONS = 0x4000, 6, 512  # host transport's exchanges: 2 tags per phase and
                                                     # generation, below TAG_CONTROL
POLL_S = 50e-6
DEPARTURE_POLL_S = 2e-3  # how often a wait looks for departure notices of the ranks it waits for
STALL_S, STALL_FRACTION = 0.2, 0.25  # a wait's loop that did not run for max(STALL_S, STALL_FRACTION * timeout)
                                     # says that this rank was stopped or starved (Clock)


class Departures:
    """Departure notices over an mpi4py communicator: a rank that leaves (finalize, or an exception it did
    not handle) sends every other rank one message (tag TAG_LEAVE) with its reason; every bounded wait of
    moecomm on MPI looks for the notices of the ranks it waits for and raises PeerExited naming a rank that
    left, instead of waiting for it until the timeout. Once this rank has left itself, the waits that follow
    (the teardown) expect the peers' notices and do not raise on them."""

    def __init__(self, mpi):
        self.mpi, self.rank, self.size = mpi, mpi.Get_rank(), mpi.Get_size()
        self.left, self.gone, self._sends, self._next_poll = False, {}, [], 0.0

    def leave(self, reason):
        """Send this rank's notice to every other rank (once; completes at once: a small message)."""
        if not self.left:
            self.left = True
            self._sends = [self.mpi.isend(reason, dest=q, tag=TAG_LEAVE) for q in range(self.size) if q != self.rank]
            deadline = time.monotonic() + 1.0  # eager sends complete locally; never wait long for a dead peer
            while self._sends and time.monotonic() < deadline and not all(r.Test() for r in self._sends):
                time.sleep(POLL_S)

    def seen(self, ranks):
        """{rank: reason} of ``ranks`` whose notice has come (never waits)."""
        for q in ranks:
            if q != self.rank and q not in self.gone and self.mpi.iprobe(source=q, tag=TAG_LEAVE):
                self.gone[q] = self.mpi.recv(source=q, tag=TAG_LEAVE)
        return {q: self.gone[q] for q in ranks if q in self.gone}

    def check(self, ranks, what, still_missing):
        """Raise PeerExited naming a rank of ``ranks`` that has left while ``still_missing()``, asked after its
        notice was read, still names it (looked for at most every DEPARTURE_POLL_S). A rank sends its notice
        after its last message, and MPI delivers one sender's messages in order: a message that is missing
        once the notice is here will never come, while one that was merely late is found by the second look."""
        now = time.monotonic()
        if self.left or now < self._next_poll:
            return
        self._next_poll = now + DEPARTURE_POLL_S
        gone = self.seen(ranks)
        if gone:
            still = set(still_missing())
            gone = {q: why for q, why in gone.items() if q in still}
        if gone:
            q = min(gone)
            raise PeerExited(f"{what}: rank {q} left the job ({gone[q]}); it will not take part in this call",
                             peer=q, phase=what, reason=gone[q])


def exchange_tag(phase, generation):
    """The tag of a host-transport exchange's headers (its rows use tag + 1) for ``phase`` (0 .. PHASES - 1:
    the host transport's exchanges, moecomm.transport.host) in ``generation`` (AllToAll.mask_ranks starts a
    new one): messages left behind by a failed call of an earlier generation can never be received by a
    later one."""
    return TAG_EXCHANGE + 2 * PHASES * (generation % GENERATIONS) + 2 * phase


def wait_all(requests, peers, deadline, timeout_s, what, departures=None):
    """Wait for MPI ``requests`` (``peers[i]`` is the rank behind request i) until ``deadline``
    (time.monotonic()); on expiry, once the requests have been tested again (a rank resumed from a stall finds
    its messages waiting), raise CommTimeout naming the first silent rank, never this one. With ``departures``
    (a :class:`Departures`, which also says which rank this is), a silent rank that has left is named at once
    (PeerExited)."""
    from mpi4py import MPI
    me = departures.rank if departures is not None else -1
    clock = Clock(timeout_s, deadline)

    def silent():  # the other ranks behind the requests not complete yet
        return sorted({p for p, r in zip(peers, requests) if not r.Test() and p != me})

    while not MPI.Request.Testall(requests):
        if departures is not None:
            departures.check(silent(), what, silent)
        if clock.tick() > deadline:
            ranks = silent()
            if MPI.Request.Testall(requests):
                return
            raise CommTimeout(f"{what}: no message from rank(s) {ranks} within {timeout_s:g} s (a rank may have "
                              f"died, stalled or skipped the call){clock.late()}",
                              peer=ranks[0] if ranks else -1, phase=what)
        time.sleep(POLL_S)


class Clock:
    """The time of a bounded wait's loop, and the longest this rank went between two of its looks: a rank
    stopped (SIGSTOP, a debugger) or starved of CPU past the deadline says so when it times out, since its
    peers may have waited for it rather than it for them."""

    def __init__(self, timeout_s, deadline):
        self.last, self.gap, self.stalled_s = time.monotonic(), 0.0, max(STALL_S, STALL_FRACTION * timeout_s)
        self.after = self.last - deadline  # > 0: the wait began past its deadline (the call's halves were apart)

    def tick(self):
        """time.monotonic(), noting the gap since the last tick."""
        now = time.monotonic()
        self.gap, self.last = max(self.gap, now - self.last), now
        return now

    def late(self):
        """"" or the clause saying that this rank was itself late: not running for a while of the wait, or
        reaching it past its deadline."""
        if self.after > 0:
            return (f"; this rank began waiting {self.after:.3g} s after the deadline (its call's halves were that far "
                    f"apart, or it was stopped): it may be the late one")
        if self.gap >= self.stalled_s:
            return (f"; this rank itself did not run for {self.gap:.3g} s of the wait (stopped or starved of CPU): "
                    f"it may be the late one")
        return ""


_inits = {}  # {an MPI communicator's handle: the inits this process began on it} (duplicate)


def duplicate(mpi, timeout_s):
    """A duplicate of the mpi4py communicator ``mpi`` (MPI_Comm_idup, collective, bounded by ``timeout_s``):
    moecomm's messages and departure notices travel on it, so that a communicator that broke and was
    finalized leaves nothing on the program's (init() on the same one again starts clean), and the program's
    own messages on it never meet moecomm's. Each rank first tells every other one which of its inits on
    ``mpi`` this is (tag TAG_INIT), so that a CommTimeout names a rank that never came."""
    from mpi4py import MPI
    key = mpi.py2f()
    number = _inits[key] = _inits.get(key, 0) + 1
    others = [q for q in range(mpi.Get_size()) if q != mpi.Get_rank()]
    sends = [mpi.isend(number, dest=q, tag=TAG_INIT) for q in others]
    dup, request = mpi.Idup()
    deadline = time.monotonic() + timeout_s
    clock, came = Clock(timeout_s, deadline), {}  # {rank: the latest of its inits it announced}

    def look():  # the announcements that have come (never waits; the rest are taken by a later init)
        status = MPI.Status()
        while (message := mpi.improbe(source=MPI.ANY_SOURCE, tag=TAG_INIT, status=status)) is not None:
            came[status.Get_source()] = message.recv()

    while not request.Test():
        if clock.tick() > deadline:
            look()
            absent = [q for q in others if came.get(q, 0) < number]
            raise CommTimeout(f"init: rank(s) {absent} of the MPI communicator did not come within {timeout_s:g} s "
                              f"(a rank may have died or not called init){clock.late()}",
                              peer=absent[0] if absent else -1, phase="init")
        time.sleep(POLL_S)
    look()
    wait_all(sends, others, deadline + timeout_s, timeout_s, "init")
    return dup


class Control:
    """Bounded control collectives over an mpi4py communicator: every rank sends its bytes to every rank
    (point to point, tag TAG_CONTROL) tagged with the operation's name and a step number, so that a silent
    rank is named and two ranks in different operations raise OutOfStep instead of pairing up.

    A collective among a subset of the ranks (the others may be dead) uses its own tag and no step number:
    a rank that missed earlier subset operations (it was masked) can still take part in the next one."""

    def __init__(self, mpi):
        self.mpi, self.rank, self.size = mpi, mpi.Get_rank(), mpi.Get_size()
        self._step = 0
        self.departures = Departures(mpi)

    def allgather(self, data, what, timeout_s, ranks=None):
        """Every rank's ``data`` (bytes), by rank (of ``ranks`` only, in their order, when given). Raises
        CommTimeout naming a rank that did not take part within ``timeout_s``, OutOfStep when a rank is in
        another control operation."""
        ranks, tag = (range(self.size), TAG_CONTROL) if ranks is None else (ranks, TAG_SUBSET)
        if tag == TAG_CONTROL:
            self._step += 1
        step_now = self._step if tag == TAG_CONTROL else 0
        mine = (step_now, what, bytes(data))
        deadline = time.monotonic() + timeout_s
        clock = Clock(timeout_s, deadline)
        others = [q for q in ranks if q != self.rank]
        sends = [self.mpi.isend(mine, dest=d, tag=tag) for d in others]
        got, missing = {self.rank: bytes(data)}, list(others)

        def receive():  # take the messages that have come; the ranks still missing
            for s in list(missing):
                message = self.mpi.improbe(source=s, tag=tag)
                if message is None:
                    continue
                step, op, payload = message.recv()
                if (step, op) != (step_now, what):
                    raise OutOfStep(f"{what}: rank {s} is in {op!r} (control step {step}) while this rank is in "
                                    f"{what!r} (step {step_now}): the ranks' calls differ")
                got[s] = payload
                missing.remove(s)
            return missing

        while receive():
            self.departures.check(missing, what, receive)
            if missing and clock.tick() > deadline and receive():
                raise CommTimeout(f"{what}: no answer from rank(s) {missing} within {timeout_s:g} s (a rank may "
                                  f"have died, stalled or skipped the call){clock.late()}", peer=missing[0],
                                  phase=what)
            if missing:
                time.sleep(POLL_S)
        wait_all(sends, others, deadline, timeout_s, what, self.departures)
        return [got[r] for r in ranks]
