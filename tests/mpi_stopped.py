"""A rank stopped (SIGSTOP) past the timeout inside a dispatch, then resumed, names the right rank: never
itself, and it says that it was the late one.

    mpiexec -n 2 python tests/mpi_stopped.py

Rank 0 stops rank 1 while rank 1 waits in a dispatch, and resumes it after the timeout:

* ``arrived``: rank 0 makes its dispatch while rank 1 is stopped, so everything rank 1 waited for arrives
  meanwhile; rank 0 times out naming rank 1 (whose rows never came). Resumed, rank 1 either completes its
  dispatch or raises naming rank 0 (which has left): never a timeout naming itself or nobody.
* ``missing``: rank 0 makes no call while rank 1 is stopped; resumed past its deadline, rank 1 raises
  CommTimeout naming rank 0 and saying that it did not run for most of the wait itself.

Each case breaks the communicator; every rank then starts a new one on the same MPI communicator.
"""
import os
import signal
import subprocess
import sys
import time

import numpy as np

import moecomm
from report import report

TIMEOUT, E_PER_RANK, H, M = 2.0, 2, 64, 4


def dispatch(a2a, W):
    E = E_PER_RANK * W
    a2a.dispatch(np.zeros(E_PER_RANK, np.int32), np.zeros((E_PER_RANK, a2a.cfg.expert_capacity, H), np.float16), None,
                 np.ones((M, H), np.float16), None, (np.arange(M, dtype=np.int32) % E)[:, None].copy(),
                 np.array([M], np.int32))


def stopped_for(pid, seconds):
    """Stop process ``pid`` now and resume it after ``seconds`` (from a shell, whatever this process does)."""
    os.kill(pid, signal.SIGSTOP)
    subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {pid}"])


def case(name, comm, pids, fails):
    """One case; returns the exception this rank raised (or None)."""
    W, r = comm.world_size, comm.rank
    a2a = moecomm.AllToAll(comm, M, E_PER_RANK * W, 1, H, None, "float16", "float16")
    raised = None
    try:
        if r == 1:
            dispatch(a2a, W)  # stopped inside it by rank 0
            if name == "missing":
                fails.append("missing: rank 1's dispatch completed without rank 0's")
            a2a.combine(np.zeros((M, H), np.float16), (np.arange(M, dtype=np.int32) % (E_PER_RANK * W))[:, None],
                        np.ones((M, 1), np.float32), np.zeros((E_PER_RANK, a2a.cfg.expert_capacity, H), np.float16),
                        np.array([M], np.int32))
        else:
            time.sleep(0.5)  # rank 1 is waiting in its dispatch by now
            stopped_for(pids[1], TIMEOUT + 1.5)
            if name == "missing":
                time.sleep(TIMEOUT + 2.5)  # rank 1 resumes past its deadline, with nothing of this rank's
            t0 = time.monotonic()
            dispatch(a2a, W)
            fails.append(f"{name}: rank 0's dispatch completed without rank 1's")
    except moecomm.MoeCommError as e:
        raised = e
        if r == 0 and name == "arrived" and not (isinstance(e, moecomm.CommTimeout) and e.peer == 1
                                                 and time.monotonic() - t0 <= TIMEOUT + 1):
            fails.append(f"arrived: rank 0 raised {type(e).__name__} (peer {getattr(e, 'peer', None)}): {e}")
        if r == 1 and getattr(e, "peer", None) != 0:
            fails.append(f"{name}: the resumed rank raised {type(e).__name__} naming peer "
                         f"{getattr(e, 'peer', None)}, not rank 0: {e}")
        if r == 1 and name == "missing" and "it may be the late one" not in str(e):
            fails.append(f"missing: the resumed rank's error does not say it was late: {e}")
    comm.finalize()
    return raised


def main():
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if world.Get_size() != 2:
        print("mpi_stopped.py runs on 2 ranks", file=sys.stderr)
        return 2
    pids = world.allgather(os.getpid())
    fails, checks = [], 0
    for name in ("arrived", "missing"):
        comm = moecomm.init(transport="host", timeout=TIMEOUT)
        raised = case(name, comm, pids, fails)
        print(f"rank {world.Get_rank()} {name}: {type(raised).__name__}: {raised}", flush=True)
        checks += 1
    return report(world.allgather(fails), checks, 2, world.Get_rank())


if __name__ == "__main__":
    sys.exit(main())
