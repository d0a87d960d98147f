"""Run one rank so that a peer's death does not end it: ``python -m moecomm.shield PROGRAM ARGS...``.

    mpiexec -disable-auto-cleanup -n 3 python -m moecomm.shield python serve.py

A launcher reacts to a rank killed by a signal (SIGKILL, the OOM killer) by ending the others: MPICH's
``mpiexec`` (Hydra, the launcher ``pip install mpich`` brings) sends every other process SIGUSR1, whose default
action ends it, even with ``-disable-auto-cleanup``. The survivors then never get to name the dead rank
(CommTimeout), mask it (``AllToAll.mask_ranks``) and serve on (docs/operations.md). This wrapper stands
between the launcher and the rank: it starts PROGRAM in a session of its own with the launcher's file
descriptors (MPI's PMI connection included), takes the launcher's SIGUSR1 itself, forwards SIGINT, SIGTERM and
SIGHUP (stopping the job still stops the rank; SIGKILL follows after GRACE_S if it has not ended), and exits
with PROGRAM's status (128 + the signal's number when a signal ended it).
"""
import signal
import subprocess
import sys

GRACE_S = 10.0  # after a forwarded stop, the rank's time to end before SIGKILL
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    # the launcher's notice that a peer died is not the end of this rank: ignored here until this process ends
    # (Hydra may send it again as the survivors finish), the rank starting with SIGUSR1 as it would have
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    rank = subprocess.Popen(argv, start_new_session=True, close_fds=False,  # close_fds=False: MPI's PMI descriptor
                            preexec_fn=lambda: signal.signal(signal.SIGUSR1, signal.SIG_DFL))
    stopping = []

    def forward(signum, _frame):
        rank.send_signal(signum)
        stopping.append(signum)

    for s in FORWARDED:
        signal.signal(s, forward)
    while True:
        try:
            status = rank.wait(GRACE_S if stopping else None)
            break
        except subprocess.TimeoutExpired:  # stopped and still running: ended
            rank.kill()
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main())
