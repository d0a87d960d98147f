"""MPI with deadlines: every wait of moecomm on MPI is non-blocking and bounded, and names who is silent.

moecomm's messages travel on the caller's communicator under its own tags (``TAG_*`` below), point to
point, so that a rank that does not answer can be named (a collective would only say "someone").
"""
import time

from ._errors import CommTimeout, OutOfStep

TAG_CONTROL, TAG_SUBSET = 0x6C00, 0x6C01            # control collectives of the bootstrap: all ranks, a subset
TAG_PEER_CHECK = 0x6D20                              # host transport's peer check
TAG_EXCHANGE, GENERATIONS = 0x4000, 1024             # host transport's exchanges: 6 tags per generation
POLL_S = 50e-6


def exchange_tag(phase, generation):
    """The tag of a host-transport exchange's headers (its rows use tag + 1) for ``phase`` (0: dispatch,
    1: combine, 2: dispatch demand) in ``generation`` (AllToAll.mask_ranks starts a new one): messages left
    behind by a failed call of an earlier generation can never be received by a later one."""
    return TAG_EXCHANGE + 6 * (generation % GENERATIONS) + 2 * phase


def wait_all(requests, peers, deadline, timeout_s, what):
    """Wait for MPI ``requests`` (``peers[i]`` is the rank behind request i) until ``deadline``
    (time.monotonic()); on expiry raise CommTimeout naming the first silent rank."""
    from mpi4py import MPI
    while not MPI.Request.Testall(requests):
        if time.monotonic() > deadline:
            silent = sorted({p for p, r in zip(peers, requests) if not r.Test()})
            raise CommTimeout(f"{what}: no message from rank(s) {silent} within {timeout_s:g} s "
                              f"(a rank may have died, stalled or skipped the call)",
                              peer=silent[0] if silent else -1, phase=what)
        time.sleep(POLL_S)


class Control:
    """Bounded control collectives over an mpi4py communicator: every rank sends its bytes to every rank
    (point to point, tag TAG_CONTROL) tagged with the operation's name and a step number, so that a silent
    rank is named and two ranks in different operations raise OutOfStep instead of pairing up.

    A collective among a subset of the ranks (the others may be dead) uses its own tag and no step number:
    a rank that missed earlier subset operations (it was masked) can still take part in the next one."""

    def __init__(self, mpi):
        self.mpi, self.rank, self.size = mpi, mpi.Get_rank(), mpi.Get_size()
        self._step = 0

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
        others = [q for q in ranks if q != self.rank]
        sends = [self.mpi.isend(mine, dest=d, tag=tag) for d in others]
        got, missing = {self.rank: bytes(data)}, list(others)
        while missing:
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
            if missing and time.monotonic() > deadline:
                raise CommTimeout(f"{what}: no answer from rank(s) {missing} within {timeout_s:g} s (a rank may "
                                  f"have died, stalled or skipped the call)", peer=missing[0], phase=what)
            if missing:
                time.sleep(POLL_S)
        wait_all(sends, others, deadline, timeout_s, what)
        return [got[r] for r in ranks]
