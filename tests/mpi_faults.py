"""Fault injection: the last rank exits (or stalls) at one point of a run; every other rank must raise
CommTimeout naming it within the timeout + 1 s and then exit within 5 s (no wait at exit). With ``--mode
raise`` the last rank raises an ordinary exception there instead (its program fails): it tells its peers as
it goes, and they raise PeerExited naming it (and saying what it raised) long before the timeout.

    mpiexec -disable-auto-cleanup -n 3 python tests/mpi_faults.py --fault dispatch_send --mode exit --result DIR
    mpirun -n 2 python tests/mpi_faults.py --transport nvshmem --fault combine_recv --mode stall --result DIR

Points: init, construction, dispatch_send, dispatch_recv, combine_send, combine_recv, dispatch_backward,
combine_backward (the backward calls along the dispatch's plan), destroy, finalize.
Every surviving rank writes DIR/rank<r>.json: what it raised, naming which peer, how long after the start
of the step that raised, and when it left main(); the faulty rank writes nothing. (The launcher must not
end the job when a rank leaves without MPI_Finalize: MPICH's -disable-auto-cleanup. Open MPI ends it, so
on the GPU machine the faulty rank stalls for 4 timeouts: long after the others have written their
records.) On GPUs a dispatch or combine only launches kernels: a peer that stops answering during one is
named when the call is over, at the next synchronizing step (here destroy) or the next call.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

POINTS = ("init", "construction", "dispatch_send", "dispatch_recv", "combine_send", "combine_recv",
          "dispatch_backward", "combine_backward", "destroy", "finalize")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", choices=POINTS, required=True)
    p.add_argument("--mode", choices=["exit", "stall", "raise"], default="exit")
    p.add_argument("--timeout", type=float, default=1.0)
    p.add_argument("--transport", default="host")
    p.add_argument("--result", required=True)
    args = p.parse_args()
    from mpi4py import MPI
    rank, world = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    faulty = rank == world - 1
    step = {"name": "start", "t": time.monotonic()}

    def at(point):
        """Enter a step; the faulty rank leaves (or stalls, then leaves) here without a word."""
        step.update(name=point, t=time.monotonic())
        if faulty and args.fault == point:
            if args.mode == "raise":
                raise ValueError(f"injected fault at {point}")  # unhandled: the program ends on it
            if args.mode == "stall":
                time.sleep(4 * args.timeout)
            os._exit(0)

    import moecomm
    if args.transport != "host":  # imports and CUDA start at different speeds on different ranks (seconds
        import importlib           # apart on GPUs, more than a 1 s timeout): not part of any step
        if args.transport == "nvshmem":
            importlib.import_module("nvshmem.core")
        importlib.import_module("cupy").cuda.runtime.getDeviceCount()
    MPI.COMM_WORLD.Barrier()
    E, K, H, M = 2 * world, 2, 64, 8
    rng = np.random.default_rng(rank)
    record = {"rank": rank, "raised": None, "peer": None, "step": None, "after_s": None}
    try:
        at("init")
        comm = moecomm.init(transport=args.transport, timeout=args.timeout)
        at("construction")
        a2a = moecomm.AllToAll(comm, M, E, K, H, None, "float16", "float16", gradients=True)
        xp = np
        if args.transport != "host":
            import cupy as xp
        idx = xp.asarray(np.argsort(rng.random((M, E)), axis=1)[:, :K].astype(np.int32))
        x, w = xp.asarray(rng.standard_normal((M, H)).astype(np.float16)), xp.asarray(rng.random((M, K), np.float32))
        m = xp.array([M], np.int32)
        n, ex = xp.zeros(E // world, np.int32), xp.zeros((E // world, M * world, H), np.float16)
        out = xp.zeros((M, H), np.float16)
        at("dispatch_send")
        a2a.dispatch(n, ex, None, x, None, idx, m, do_recv=False, weights=w)
        at("dispatch_recv")
        a2a.dispatch(n, ex, None, x, None, idx, m, do_send=False, weights=w)
        plan = moecomm.RoutingPlan(*(xp.zeros(s, np.int32) for s in a2a.plan_shapes()))
        a2a.plan(plan)
        at("combine_send")
        a2a.combine(out, idx, None, ex, m, do_recv=False)
        at("combine_recv")
        a2a.combine(out, idx, None, ex, m, do_send=False)
        at("dispatch_backward")
        a2a.dispatch_backward(xp.zeros((M, H), np.float16), plan, ex, m)
        at("combine_backward")
        a2a.combine_backward(xp.zeros_like(ex), xp.zeros((M, K), np.float32), plan, out, w, ex, m)
        at("destroy")
        a2a.destroy()
        at("finalize")
        comm.finalize()
    except moecomm.MoeCommError as e:
        record.update(raised=type(e).__name__, peer=getattr(e, "peer", None), step=step["name"],
                      after_s=round(time.monotonic() - step["t"], 3), message=str(e),
                      reason=getattr(e, "reason", None))
    record["left_main_at"] = time.time()
    with open(os.path.join(args.result, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    sys.exit(0)


if __name__ == "__main__":
    main()
