"""A rank that skips dispatch: every other rank raises CommTimeout within the timeout instead of hanging.

    mpiexec -n 3 python tests/mpi_timeout.py --transport host [--result FILE]
    mpirun -np 2 python tests/mpi_timeout.py --transport nvshmem
    mpirun -np 2 python tests/mpi_timeout.py --transport ipc --skip combine --max-tokens 2048

The last rank never calls dispatch (``--skip combine``: it dispatches, then never calls combine; with a
prefill-sized ``--max-tokens`` on ipc the others wait in the streamed combine's token side, cuda/combine.cu).
After the timeout the other ranks' communicator is broken, so the ranks report over plain MPI and leave
without tearing down: moecomm ends a process whose communicator broke without MPI's finalization (the last
rank's own finalization at exit then times out and ends it the same way). Rank 0 also writes its report to
--result, since a launcher may drop output.
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
    p.add_argument("--skip", choices=["dispatch", "combine"], default="dispatch", help="the call the last rank skips")
    p.add_argument("--max-tokens", type=int, default=4, help="the AllToAll's max_num_tokens (calls send 4 tokens)")
    args = p.parse_args()
    comm = moecomm.init(transport=args.transport, timeout=1.0)
    W, rank = comm.world_size, comm.rank
    E, K, H, M = 2 * W, 1, 64, 4
    a2a = moecomm.AllToAll(comm, max(M, args.max_tokens), E, K, H, in_dtype="bfloat16", out_dtype="bfloat16")
    if comm.transport.memory == "host":
        xp, put = np, np.asarray
    else:
        import cupy as xp
        put = xp.asarray
    outcome = "skipped"
    x = np.zeros((M, H), np.uint16)
    idx = (np.arange(M, dtype=np.int32) % E)[:, None].copy()
    m, ex = put(np.array([M], np.int32)), put(np.zeros((E // W, a2a.cfg.expert_capacity, H), np.uint16))

    def dispatch():
        a2a.dispatch(put(np.zeros(E // W, np.int32)), ex, None, put(x), None, put(idx), m,
                     weights=put(np.ones((M, K), np.float32)))

    if args.skip == "combine":  # every rank dispatches (weights with it: partial sums on the expert side)
        dispatch()
        if comm.transport.memory != "host":
            a2a.synchronize()
    if rank != W - 1:
        t0 = time.monotonic()
        try:
            if args.skip == "dispatch":
                dispatch()
            else:
                a2a.combine(put(np.zeros((M, H), np.uint16)), put(idx), None, ex, m)
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
