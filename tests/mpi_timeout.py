"""A rank that skips dispatch: every other rank raises CommTimeout within the timeout instead of hanging.

    mpiexec -n 3 python tests/mpi_timeout.py --transport host [--result FILE]
    mpirun -np 2 python tests/mpi_timeout.py --transport nvshmem

The last rank never calls dispatch. After the timeout the other ranks' communicator is broken, so the
ranks report over plain MPI and leave without tearing down: moecomm ends a process whose communicator
broke without MPI's finalization (the last rank's own finalization at exit then times out and ends it the
same way). Rank 0 also writes its report to --result, since a launcher may drop output.
"""
import argparse
import sys
import time

import numpy as np

import moecomm


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--transport", default="auto")
    p.add_argument("--result", help="file for rank 0's report")
    args = p.parse_args()
    comm = moecomm.init(transport=args.transport, timeout=1.0)
    W, rank = comm.world_size, comm.rank
    E, K, H, M = 2 * W, 1, 64, 4
    a2a = moecomm.AllToAll(comm, M, E, K, H, in_dtype="bfloat16", out_dtype="bfloat16")
    if comm.transport.memory == "host":
        xp, put = np, np.asarray
    else:
        import cupy as xp
        put = xp.asarray
    outcome = "skipped"
    if rank != W - 1:
        x = np.zeros((M, H), np.uint16)
        idx = (np.arange(M, dtype=np.int32) % E)[:, None].copy()
        t0 = time.monotonic()
        try:
            a2a.dispatch(put(np.zeros(E // W, np.int32)), put(np.zeros((E // W, M * W, H), np.uint16)),
                         None, put(x), None, put(idx), put(np.array([M], np.int32)))
            if comm.transport.memory != "host":
                a2a.synchronize()
            outcome = "no error"
        except moecomm.CommTimeout as e:
            took = time.monotonic() - t0
            outcome = f"CommTimeout after {took:.2f} s (peer {e.peer}, phase {e.phase})"
            if not 0.9 <= took <= 5:
                outcome = "late " + outcome
    from mpi4py import MPI
    results = MPI.COMM_WORLD.allgather(outcome)
    if rank == 0:
        report = "\n".join(f"rank {r}: {o}" for r, o in enumerate(results))
        report += f"\nCommTimeout on {sum(o.startswith('CommTimeout') for o in results)} ranks\n"
        print(report, end="", flush=True)
        if args.result:
            with open(args.result, "w") as f:
                f.write(report)
    sys.exit(0 if all(o.startswith("CommTimeout") for o in results[:-1]) else 1)


if __name__ == "__main__":
    main()
