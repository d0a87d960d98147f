"""Never silent, always collective: after a call fails on one rank, every rank raises a moecomm error for
that call, no later call returns another step's data, the next call is right, and every process exits 0.

    mpiexec -n 3 python tests/mpi_recovery.py                          # host transport, the in-process cases
    mpirun -n 2 python tests/mpi_recovery.py --transport ipc
    mpiexec -n 2 python tests/mpi_recovery.py --case destroy --result DIR   # one of the exit cases

Every step is a serving loop's step: dispatch, the "experts" (times two), combine, synchronize(). Each token
carries markers (its step, rank and index in its first three values), so a dispatch that received another
step's tokens, or a combine that summed another step's rows, is caught on every rank; each step's outputs
are also compared with moecomm.reference. The faults, all on the last rank:

* ``abort`` / ``next``: the application raises between dispatch and combine at one step; the rank reports
  it with ``a2a.abort()``, or simply by calling the next dispatch. The others raise PeerError for that step.
* ``order``: call-order refusals (do_send=do_recv=False; a receive half without its send; a dispatch receive
  half given other output arrays; a combine with no dispatch): InvalidArgument there, PeerError on the others
  for that step.
* ``weights``: the router weights go with dispatch everywhere, and the last rank also gives them to combine:
  a moecomm error on every rank (each placement alone is legal; 2 ranks or more).
* ``ids``: the last rank gives combine other expert ids than its dispatch: InvalidArgument there, PeerError on
  the others.
* ``config``: AllToAll(timeout=...) that differs on the last rank: InvalidArgument on every rank (2 ranks or
  more).
* ``restart``: the communicator breaks (OutOfStep: the last rank in another control operation; CommTimeout:
  the last rank late past the timeout; PeerExited: the last rank finalizes while the others wait for it), then
  every rank finalizes and calls ``moecomm.init()`` on MPI.COMM_WORLD again, and the new communicator's
  first step is right (2 ranks or more).

With one rank the faults are its own (no peer to tell): each raises there, and the next step is right.

The exit cases run alone (``--case``), each rank writing ``DIR/rank<r>.json``; the pytest wrapper checks that
every process exits 0:

* ``destroy``: every rank destroys its AllToAll with a dispatch send half posted, then finalizes.
* ``leave``: the last rank returns from main() (its communicator a local of main) while the others are in a
  call: they raise PeerExited within about a second (not after the timeout).
* ``finalize``: the last rank's call fails (PeerExited: rank 0 finalized first); rank 0's finalize does not
  raise for it.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import moecomm
from moecomm import reference
from report import report

E_PER_RANK, K, H, M, TIMEOUT = 2, 2, 64, 8, 5.0
STEPS, FAULT_STEP = 6, 2
xp = np  # CuPy on GPUs (main)


def host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


class Step:
    """One step's inputs on every rank (any rank can draw any rank's): markers in each token's first values."""

    def __init__(self, W, step, seed=0):
        assert 0 <= step <= 2048, f"step {step}: a marker float16 holds exactly (integers up to 2048)"
        self.W, self.step, self.E = W, step, E_PER_RANK * W
        self.x, self.ids, self.w, self.m = [], [], [], []
        for r in range(W):
            rng = np.random.default_rng([seed, step, r])
            m = int(rng.integers(1, M + 1))
            x = rng.standard_normal((m, H)).astype(np.float16)
            x[:, 0], x[:, 1], x[:, 2] = step, r, np.arange(m)
            self.x.append(x)
            self.ids.append(np.argsort(rng.random((m, self.E)), axis=1)[:, :K].astype(np.int32))
            self.w.append(rng.random((m, K), np.float32))
            self.m.append(m)
        self.ref = reference.dispatch(self.x, None, self.ids, self.E, W, M)
        y = [(q["expert_x"].astype(np.float32) * 2).astype(np.float16) for q in self.ref]
        self.want = reference.combine(self.ids, self.w, y, [q["origin"] for q in self.ref], self.E, W, np.float16)

    def arrays(self, r):
        """Rank r's device arrays of this step: inputs and fresh outputs (poisoned)."""
        return dict(out_expert_num_tokens=xp.full(E_PER_RANK, -1, np.int32),
                    out_expert_x=xp.full((E_PER_RANK, M * self.W, H), -7, np.float16), out_expert_x_scale=None,
                    dp_x=xp.asarray(self.x[r]), dp_x_scale=None, indices=xp.asarray(self.ids[r]),
                    bound_m=xp.array([self.m[r]], np.int32), weights=xp.asarray(self.w[r]))

    def check_dispatch(self, r, a, fails, label):
        """The dispatch outputs of rank r: counts, and each slot's tokens of this step as the reference has them."""
        counts = host(a["out_expert_num_tokens"])
        ex = host(a["out_expert_x"])
        want = self.ref[r]
        if not np.array_equal(counts, want["expert_num_tokens"]):
            fails.append(f"{label}: counts {counts}, want {want['expert_num_tokens']}")
            return
        for e, c in enumerate(counts):
            steps = set(ex[e, :c, 0].astype(np.float32).tolist())
            if steps - {float(self.step)}:
                fails.append(f"{label}: expert {e} received tokens of steps {sorted(steps)} (another step's data)")
            if not np.array_equal(reference.canonical_rows(c, ex[e]), reference.canonical_rows(c, want["expert_x"][e])):
                fails.append(f"{label}: expert {e}'s tokens differ from the reference")

    def check_combine(self, r, out, fails, label):
        got = host(out)[:self.m[r]].astype(np.float32)
        if not np.allclose(got, self.want[r].astype(np.float32), rtol=2 ** -8, atol=2e-3):
            fails.append(f"{label}: combined tokens differ from the reference (another step's rows?)")


def run_step(a2a, s, r, fails, label, before_combine=None, combine_weights=False, out=None):
    """One serving step of ``s`` (a Step) on rank r, checked; ``before_combine()`` runs between the phases;
    ``out``: combine's output rows ([M, H] float16, zeros), else fresh ones."""
    a = s.arrays(r)
    a2a.dispatch(**a)
    if before_combine is not None:
        before_combine()
    out = xp.zeros((M, H), np.float16) if out is None else out
    y = (a["out_expert_x"].astype(np.float32) * 2).astype(np.float16)
    a2a.combine(out, a["indices"], a["weights"] if combine_weights else None, y, a["bound_m"])
    a2a.synchronize()
    s.check_dispatch(r, a, fails, label)
    s.check_combine(r, out, fails, label)


def expect(fails, label, fn, kinds, peer=None, limit=TIMEOUT):
    """Run ``fn``; a failure unless it raises one of ``kinds`` (naming ``peer``) within ``limit`` seconds."""
    t0 = time.monotonic()
    try:
        fn()
    except kinds as e:
        if peer is not None and getattr(e, "peer", None) != peer:
            fails.append(f"{label}: {type(e).__name__} names peer {getattr(e, 'peer', None)}, expected {peer}: {e}")
        if time.monotonic() - t0 > limit:
            fails.append(f"{label}: raised after {time.monotonic() - t0:.2f} s")
        return e
    except Exception as e:  # noqa: BLE001 - any other outcome is the failure reported
        fails.append(f"{label}: raised {type(e).__name__}: {e}")
        return None
    fails.append(f"{label}: no error raised")
    return None


class AppError(Exception):
    """The application's own failure between dispatch and combine."""


def serving(comm, a2a, fails, report_by):
    """Steps 0..STEPS-1; at FAULT_STEP the last rank's application fails between dispatch and combine and it
    reports that by ``report_by`` ("abort": a2a.abort(); "next": nothing, its next dispatch ends the call)."""
    W, r, last = comm.world_size, comm.rank, comm.world_size - 1
    checks = 0
    for step in range(STEPS):
        s, label = Step(W, step, seed=len(report_by)), f"{report_by}: step {step}"
        if step == FAULT_STEP and r == last:
            def fail():
                raise AppError("the application failed between dispatch and combine")
            try:
                run_step(a2a, s, r, fails, label, before_combine=fail)
                fails.append(f"{label}: the injected application error did not happen")
            except AppError:
                if report_by == "abort":
                    a2a.abort()
        elif step == FAULT_STEP:
            out = xp.zeros((M, H), np.float16)
            expect(fails, f"{label} (rank {last} failed between the phases)",
                   lambda: run_step(a2a, s, r, fails, label, out=out), moecomm.PeerError, last)
            rows = host(out)[:s.m[r]].astype(np.float32)
            # no plausible rows: GPUs write NaN where the kernels find the call failed (the error is raised once
            # the call is over); the host transport raises in the call, before writing any
            if not (np.isnan(rows).all() if xp is not np else (rows == 0).all()):
                fails.append(f"{label}: the failed step's combine wrote plausible rows "
                             f"({'not all NaN' if xp is not np else 'not left as they were'})")
        else:
            run_step(a2a, s, r, fails, label)
        checks += 1
    return checks


def order_refusals(comm, a2a, fails):
    """Call-order refusals on the last rank; each fails its step on every rank, the next step is right."""
    W, r, last = comm.world_size, comm.rank, comm.world_size - 1
    checks = 0

    def no_halves(a):
        a2a.dispatch(**a, do_send=False, do_recv=False)

    def recv_only(a):
        a2a.dispatch(**a, do_send=False)

    def other_outputs(a):
        a2a.dispatch(**a, do_recv=False)
        b = dict(a, out_expert_num_tokens=xp.zeros_like(a["out_expert_num_tokens"]))
        a2a.dispatch(**b, do_send=False)

    def combine_first(a):
        a2a.combine(xp.zeros((M, H), np.float16), a["indices"], None, a["out_expert_x"], a["bound_m"])

    refusals = (("do_send=do_recv=False", no_halves), ("a receive half without its send", recv_only),
                ("a receive half given other outputs", other_outputs), ("a combine with no dispatch", combine_first))
    for i, (name, bad) in enumerate(refusals):
        s = Step(W, 100 + 2 * i)
        label = f"order: {name}"
        if r == last:
            expect(fails, label, lambda: bad(s.arrays(r)), moecomm.InvalidArgument)
        else:
            expect(fails, f"{label} on rank {last}", lambda: run_step(a2a, s, r, fails, label), moecomm.PeerError, last)
        run_step(a2a, Step(W, 101 + 2 * i), r, fails, f"{label}: the next step")
        checks += 1
    return checks


def disagreements(comm, a2a, fails):
    """Router weights given to combine on the last rank only; ids changed between the phases on the last rank."""
    W, r, last = comm.world_size, comm.rank, comm.world_size - 1
    checks = 1
    if W > 1:  # what only ranks that disagree can do
        s = Step(W, 200)
        expect(fails, "weights given to combine on one rank only",
               lambda: run_step(a2a, s, r, fails, "weights", combine_weights=r == last),
               (moecomm.InvalidArgument, moecomm.PeerError))
        run_step(a2a, Step(W, 201), r, fails, "weights: the next step")
        expect(fails, "AllToAll(timeout=...) that differs on one rank",
               lambda: moecomm.AllToAll(comm, M, E_PER_RANK * W, K, H, None, "float16", "float16",
                                        timeout=TIMEOUT + (1 if r == last else 0)), moecomm.InvalidArgument)
        checks += 2
    s = Step(W, 202)
    a = s.arrays(r)

    def changed_ids():
        a2a.dispatch(**a)
        ids = a["indices"]
        if r == last:
            ids = xp.asarray(np.roll(s.ids[r], 1, axis=1))  # the same experts, other positions
        a2a.combine(xp.zeros((M, H), np.float16), ids, None, a["out_expert_x"], a["bound_m"])
        a2a.synchronize()
    expect(fails, "ids changed between dispatch and combine" + ("" if r == last else f" on rank {last}"), changed_ids,
           moecomm.InvalidArgument if r == last else moecomm.PeerError, None if r == last else last)
    run_step(a2a, Step(W, 203), r, fails, "ids: the next step")
    return checks


def restarts(comm, transport, fails):
    """Break the communicator three ways, each time finalizing it and starting a new one on the same MPI
    communicator (COMM_WORLD), whose first step must be right. Returns (the communicator in use, checks)."""
    W, r, last = comm.world_size, comm.rank, comm.world_size - 1
    if W == 1:
        return comm, 0

    def out_of_step():
        if r == last:
            comm.barrier()
        else:
            comm.allgather(r, "not the barrier")

    def late():
        if r != last:
            comm.barrier()
            return
        time.sleep(TIMEOUT + 1)  # the others time out waiting for it and leave their broken communicator
        try:  # their barrier messages came before they timed out: this one may complete, or learn they left
            comm.barrier()
        except moecomm.CommTimeout:
            pass

    def gone():
        if r == last:
            comm.finalize()  # while the others wait for it
        else:
            comm.barrier()

    breaks = (("OutOfStep", out_of_step, moecomm.OutOfStep, None),
              ("CommTimeout", late, None if r == last else moecomm.CommTimeout, last),
              ("PeerExited", gone, None if r == last else moecomm.PeerExited, last))
    for i, (name, fault, kind, peer) in enumerate(breaks):
        label = f"restart after {name}"
        if kind is None:
            fault()
        else:
            expect(fails, label, fault, kind, peer, limit=TIMEOUT + 2)
        comm.finalize()
        try:
            comm = moecomm.init(transport=transport, timeout=TIMEOUT)
            a2a = moecomm.AllToAll(comm, M, E_PER_RANK * W, K, H, None, "float16", "float16")
            run_step(a2a, Step(W, 300 + i), r, fails, f"{label}: the new communicator's first step")
            a2a.destroy()
        except moecomm.MoeCommError as e:
            fails.append(f"{label}: the new communicator raised {type(e).__name__}: {e}")
            raise
    return comm, len(breaks)


def exit_case(case, transport, result):
    """The cases that end the program; each rank records what it saw in result/rank<r>.json."""
    comm = moecomm.init(transport=transport, timeout=TIMEOUT)
    W, r, last = comm.world_size, comm.rank, comm.world_size - 1
    record = {"rank": r, "raised": None, "after_s": None}
    a2a = moecomm.AllToAll(comm, M, E_PER_RANK * W, K, H, None, "float16", "float16")
    run_step(a2a, Step(W, 0), r, [], "warm-up")
    if case == "destroy":
        a = Step(W, 1).arrays(r)
        a2a.dispatch(**a, do_recv=False)
        a2a.destroy()
        comm.finalize()
    elif case in ("leave", "finalize"):
        if r == last and case == "leave":
            return record  # main() returns: the communicator is a local of main()
        if case == "finalize" and r == 0:
            comm.finalize()  # first; the others are in a call with it
        else:
            t0 = time.monotonic()
            try:
                run_step(a2a, Step(W, 1), r, [], "the call with a rank gone")
            except moecomm.MoeCommError as e:
                record.update(raised=type(e).__name__, peer=getattr(e, "peer", None), after_s=time.monotonic() - t0)
            comm.finalize()
    Path(result, f"rank{r}.json").write_text(json.dumps(record))
    return record


def main():
    global xp
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transport", default="host")
    p.add_argument("--case", default="all", choices=["all", "destroy", "leave", "finalize"])
    p.add_argument("--result", help="the exit cases' folder for rank<r>.json")
    args = p.parse_args()
    if args.transport != "host":
        import cupy
        xp = cupy
    if args.case != "all":
        exit_case(args.case, args.transport, args.result)
        return 0
    comm = moecomm.init(transport=args.transport, timeout=TIMEOUT)
    a2a = moecomm.AllToAll(comm, M, E_PER_RANK * comm.world_size, K, H, None, "float16", "float16")
    fails, checks = [], 0
    checks += serving(comm, a2a, fails, "abort")
    checks += serving(comm, a2a, fails, "next")
    checks += order_refusals(comm, a2a, fails)
    checks += disagreements(comm, a2a, fails)
    a2a.destroy()
    comm, n = restarts(comm, args.transport, fails)
    checks += n
    everyone = comm.allgather(fails)
    comm.finalize()
    return report(everyone, checks, comm.world_size, comm.rank)


if __name__ == "__main__":
    sys.exit(main())
