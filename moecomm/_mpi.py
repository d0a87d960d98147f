"""MPI with deadlines: every wait of moecomm on MPI is non-blocking and bounded, and names who is silent.

moecomm's messages travel on the caller's communicator under its own tags (``TAG_*`` below), point to
point, so that a rank that does not answer can be named (a collective would only say "someone").
"""
import time

from ._errors import CommTimeout, OutOfStep

TAG_CONTROL = 0x6C00                                 # control collectives of the bootstrap
TAG_DISPATCH, TAG_COMBINE, TAG_PEER_CHECK = 0x6D00, 0x6D10, 0x6D20  # host transport; each uses tag, tag + 1
POLL_S = 50e-6


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
    rank is named and two ranks in different operations raise OutOfStep instead of pairing up."""

    def __init__(self, mpi):
        self.mpi, self.rank, self.size = mpi, mpi.Get_rank(), mpi.Get_size()
        self._step = 0

    def allgather(self, data, what, timeout_s):
        """Every rank's ``data`` (bytes), by rank. Raises CommTimeout naming a rank that did not take part
        within ``timeout_s``, MoeCommError when a rank is in another control operation."""
        self._step += 1
        mine = (self._step, what, bytes(data))
        deadline = time.monotonic() + timeout_s
        sends = [self.mpi.isend(mine, dest=d, tag=TAG_CONTROL) for d in range(self.size) if d != self.rank]
        got, missing = {self.rank: bytes(data)}, [s for s in range(self.size) if s != self.rank]
        while missing:
            for s in list(missing):
                message = self.mpi.improbe(source=s, tag=TAG_CONTROL)
                if message is None:
                    continue
                step, op, payload = message.recv()
                if (step, op) != (self._step, what):
                    raise OutOfStep(f"{what}: rank {s} is in {op!r} (control step {step}) while this rank is in "
                                    f"{what!r} (step {self._step}): the ranks' calls differ")
                got[s] = payload
                missing.remove(s)
            if missing and time.monotonic() > deadline:
                raise CommTimeout(f"{what}: no answer from rank(s) {missing} within {timeout_s:g} s (a rank may "
                                  f"have died, stalled or skipped the call)", peer=missing[0], phase=what)
            if missing:
                time.sleep(POLL_S)
        wait_all(sends, [d for d in range(self.size) if d != self.rank], deadline, timeout_s, what)
        return [got[r] for r in range(self.size)]
