"""Calls from two threads of a rank: one call at a time per communicator, enforced, and nothing silent.

    mpiexec -n 2 python tests/mpi_threads.py
    mpirun -n 2 python tests/mpi_threads.py --transport ipc

* ``refused`` (host transport, whose calls wait for their peers inside them; a GPU call only launches): while
  a thread of rank 0 is inside a dispatch (rank 1 comes late), its main thread calls dispatch and combine on
  the same AllToAll, dispatch on another one, a barrier and abort(): each raises ConcurrentCall at once; then
  the first thread's step is right on every rank, and so is the next one.
* ``threads``: every rank runs two threads, each serving its own AllToAll (``shared``: both the same one) for
  STEPS steps with call ids, and making a call again when it was refused (ConcurrentCall): the threads take
  turns, but not in the same order on every rank. Every step that returns is right (markers in each token
  name its step and rank); a step that fails raises a moecomm error (OutOfStep where the ranks' orders
  differ; a call another thread's dispatch ended), and then the next step from one thread is right or raises
  a moecomm error too (CommBroken; a timeout where the ranks' calls no longer pair).
"""
import argparse
import sys
import threading
import time

import numpy as np

import moecomm
import mpi_recovery
from mpi_recovery import E_PER_RANK, H, K, M, TIMEOUT, Step, run_step
from report import report

STEPS = 20


def refused(comm, fails):
    """One thread inside a dispatch; the other's calls are refused at once; both steps after are right."""
    W, r = comm.world_size, comm.rank
    a2a, other = (moecomm.AllToAll(comm, M, E_PER_RANK * W, K, H, None, "float16", "float16") for _ in range(2))
    s = Step(W, 400)
    if r != 0:
        time.sleep(3.0)  # rank 0's thread waits for this rank in its dispatch meanwhile
        run_step(a2a, s, r, fails, "refused: the first thread's step")
    else:
        a = s.arrays(r)
        inside = threading.Thread(target=lambda: a2a.dispatch(**a))
        inside.start()
        deadline = time.monotonic() + 2.0
        while not repr(comm.calls.lock).startswith("<locked"):  # looked at, not taken: the thread may enter
            if time.monotonic() > deadline:
                fails.append("refused: the first thread did not enter its dispatch within 2 s")
                break
            time.sleep(0.01)
        b = Step(W, 401).arrays(r)
        calls = (("dispatch on the same AllToAll", lambda: a2a.dispatch(**b)),
                 ("combine on the same AllToAll", lambda: a2a.combine(mpi_recovery.xp.zeros((M, H), np.float16),
                                                                        b["indices"], None, b["out_expert_x"],
                                                                        b["bound_m"])),
                 ("dispatch on another AllToAll", lambda: other.dispatch(**b)),
                 ("barrier", comm.barrier), ("abort", a2a.abort))
        for name, call in calls:
            t0 = time.monotonic()
            try:
                call()
                fails.append(f"refused: {name} from a second thread was not refused")
            except moecomm.ConcurrentCall:
                if time.monotonic() - t0 > 0.1:
                    fails.append(f"refused: {name} was refused after {time.monotonic() - t0:.2f} s, not at once")
            except Exception as e:  # noqa: BLE001 - any other outcome is the failure reported
                fails.append(f"refused: {name} from a second thread raised {type(e).__name__}: {e}")
        inside.join()
        s.check_dispatch(r, a, fails, "refused: the first thread's dispatch")
        out = mpi_recovery.xp.zeros((M, H), np.float16)
        a2a.combine(out, a["indices"], None, (a["out_expert_x"].astype(np.float32) * 2).astype(np.float16),
                    a["bound_m"])
        a2a.synchronize()
        s.check_combine(r, out, fails, "refused: the first thread's combine")
    run_step(a2a, Step(W, 402), r, fails, "refused: the next step")
    run_step(other, Step(W, 403), r, fails, "refused: the other AllToAll's next step")
    a2a.destroy()
    other.destroy()
    return 1


def threads(comm, fails, shared):
    """Two threads, each with its own AllToAll (``shared``: one for both) and call ids, taking turns by making
    refused calls again."""
    W, r = comm.world_size, comm.rank
    a2as = [moecomm.AllToAll(comm, M, E_PER_RANK * W, K, H, None, "float16", "float16") for _ in range(2 - shared)]
    a2as *= 1 + shared
    label = "threads on one AllToAll" if shared else "threads"
    raised, returned = [], [0, 0]

    def again(call):  # a call refused because the other thread is inside one: made again after it
        while True:
            try:
                return call()
            except moecomm.ConcurrentCall:
                time.sleep(1e-4)

    def serve(t):
        a2a = a2as[t]
        try:
            for step in range(STEPS):
                s = Step(W, 1000 * (t + 1) + step)
                a = s.arrays(r)
                a["call_id"] = mpi_recovery.xp.array([1000 * (t + 1) + step], np.int32)
                again(lambda: a2a.dispatch(**a))
                out = mpi_recovery.xp.zeros((M, H), np.float16)
                y = (a["out_expert_x"].astype(np.float32) * 2).astype(np.float16)
                again(lambda: a2a.combine(out, a["indices"], None, y, a["bound_m"]))
                again(a2a.synchronize)
                s.check_dispatch(r, a, fails, f"{label}: thread {t} step {step}")
                s.check_combine(r, out, fails, f"{label}: thread {t} step {step}")
                returned[t] += 1
        except (moecomm.MoeCommError, moecomm.InvalidArgument) as e:
            raised.append(e)
        except Exception as e:  # noqa: BLE001 - any other outcome is the failure reported
            fails.append(f"{label}: thread {t} raised {type(e).__name__}: {e}")

    workers = [threading.Thread(target=serve, args=(t,)) for t in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    try:  # from one thread: right, or (where a thread's call raised) a moecomm error, never another call's data
        if any(a2a._order.done for a2a in a2as):  # a call a thread left open (it raised between the halves)
            a2as[0].abort()
        run_step(a2as[0], Step(W, 2040 + shared), r, fails, f"{label}: the step after, from one thread")
    except (moecomm.MoeCommError, moecomm.InvalidArgument) as e:
        if not raised:
            fails.append(f"{label}: the step after threads that raised nothing raised {type(e).__name__}: {e}")
    print(f"rank {r}: {label} returned {returned} steps; raised "
          f"{[f'{type(e).__name__}: {e}'[:120] for e in raised]}", flush=True)
    return 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transport", default="host")
    args = p.parse_args()
    if args.transport != "host":
        import cupy
        mpi_recovery.xp = cupy
    comm = moecomm.init(transport=args.transport, timeout=TIMEOUT)
    fails, checks = [], 0
    if comm.world_size > 1 and comm.transport.name == "host":  # where a call waits for its peers inside it
        checks += refused(comm, fails)
    for shared in (False, True):
        checks += threads(comm, fails, shared)
        if comm.broken or shared:  # replaced by a new one (a shared AllToAll's ranks may no longer pair)
            comm.finalize()
            comm = moecomm.init(transport=args.transport, timeout=TIMEOUT)
    everyone = comm.allgather(fails)
    comm.finalize()
    return report(everyone, checks, comm.world_size, comm.rank)


if __name__ == "__main__":
    sys.exit(main())
