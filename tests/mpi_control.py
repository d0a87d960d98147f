"""The control path under MPI, on either transport: a failed call is still collective, calls that do not
belong together are refused, equal configurations compare equal. Every rank checks what it raised.

    mpiexec -n 3 python tests/mpi_control.py                       # host transport (numpy)
    mpirun -n 2 python tests/mpi_control.py --transport nvshmem    # GPUs (CuPy arrays)
    mpirun -n 1 python tests/mpi_control.py --transport ipc        # one rank: the checks that need no other

A call "raises by its end" when one of its steps (dispatch, then combine) or the ``synchronize()`` after
them raises: the host transport raises in the step itself, GPU kernels record the error and it is raised
once the call is over (after combine's receive half is issued) or by synchronize().

* a bad argument on the last rank, at each argument position of dispatch and of combine: the last rank
  raises InvalidArgument at once, every other rank PeerError naming it by the end of the call, within
  the timeout; the next call is correct on every rank;
* bad routing on the last rank (an expert id out of range; bound_m out of range): InvalidRouting on every
  rank by the end of the call, the last rank's out_tokens untouched; the next call is correct;
* AllToAll construction with a bad argument on one rank raises on every rank; dtypes spelled differently
  on different ranks ("fp16", np.float16) are the same configuration;
* every rank dispatching twice without combining: the second dispatch ends the first call with a warning
  and runs as the next call, which is right;
* a combine whose bound_m differs from the dispatched m on the last rank: InvalidArgument there, PeerError
  on the others;
* an output the last rank cannot write (read-only): InvalidArgument there, PeerError on the others; an
  out_tokens with fewer rows than m on the last rank: InvalidRouting on every rank; the next call works;
* a repeated expert id on the last rank, raised by synchronize() right after the dispatch (on GPUs; the host
  transport raises in the dispatch): that ends the call, and the next dispatch (no combine in between) works
  on every rank;
* prepared calls (AllToAll.prepare_dispatch / prepare_combine) run three steps, their inputs rewritten in
  place before each: every step matches the reference;
* pplx-kernels' calling convention (out_tokens of max_num_tokens rows, indices and weights of m rows,
  uint32 ids and bound_m, weights at combine) and DeepEP's (int64 ids with -1 slots) match the reference;
* two AllToAlls called in different orders on different ranks: OutOfStep (host) or CommTimeout (GPU: each
  AllToAll has its own buffers and signals, so the calls cannot pair; they wait for each other until the
  timeout) on every rank, after which the communicator is broken (CommBroken at once) and finalize()
  does not wait.

``--replay dispatch|combine`` (GPU transports) runs one case instead: a call's dispatch and its combine captured
into two CUDA graphs (``a2a.captured()``), replayed in order (right), then replayed out of order, as a framework
that reorders or repeats replayed calls would: the combine once more, or the dispatch twice (the second with no
combine after the first): ``a2a.check()`` raises OutOfStep on every rank (the kernels count each half's calls),
a combine replayed again leaves out_tokens alone, and the communicator is broken (CommBroken at once).
Prints "<n> checks on <w> ranks: <f> failures" on rank 0.
"""
import argparse
import sys
import time
import warnings

import numpy as np

import moecomm
from moecomm import reference
from report import report

E_PER_RANK, K, H, M, TIMEOUT = 2, 2, 64, 8, 2.0
xp = np  # the array module of the transport (CuPy on GPUs), set in main()


def host(a):
    return a.get() if hasattr(a, "get") else a


def unwritten(a, value):
    """Whether a failed call's output rows hold nothing plausible: left as they were (``value``), or, on GPUs,
    NaN in every row (CombineArgs.nan_failed: a combine the kernels find failed writes NaN where the host cannot
    refuse it first)."""
    rows = host(a).astype(np.float32)
    return bool((rows == value).all() or (xp is not np and np.isnan(rows).all()))


def good(W, r, seed):
    """Valid dispatch arguments of rank r of W as numpy arrays (any rank can draw any rank's)."""
    rng = np.random.default_rng([seed, r])
    E = E_PER_RANK * W
    return dict(out_expert_num_tokens=np.full(E_PER_RANK, -1, np.int32),
                out_expert_x=np.zeros((E_PER_RANK, M * W, H), np.float16),
                out_expert_x_scale=None,
                dp_x=rng.standard_normal((M, H)).astype(np.float16), dp_x_scale=None,
                indices=np.argsort(rng.random((M, E)), axis=1)[:, :K].astype(np.int32),
                bound_m=np.array([M], np.int32), weights=rng.random((M, K), np.float32))


def on_device(args):
    return {k: None if v is None else xp.asarray(v) for k, v in args.items()}


def roundtrip(comm, a2a, seed):
    """A valid dispatch + combine (the expert is the identity), checked against the reference."""
    W, r = comm.world_size, comm.rank
    everyone = [good(W, q, seed) for q in range(W)]
    args = on_device(everyone[r])
    a2a.dispatch(**args)
    out = xp.zeros((M, H), np.float16)
    a2a.combine(out, args["indices"], None, args["out_expert_x"], args["bound_m"])
    a2a.synchronize()
    return right(everyone, r, args, out)


def prepared_steps(comm, a2a, seed, steps=3):
    """A prepared dispatch and combine run ``steps`` times, their inputs rewritten in place before each
    (AllToAll.prepare_dispatch / prepare_combine): whether every step is right."""
    W, r = comm.world_size, comm.rank
    args, out = on_device(good(W, r, seed)), xp.zeros((M, H), np.float16)
    dispatch = a2a.prepare_dispatch(**args)
    combine = a2a.prepare_combine(out, args["indices"], None, args["out_expert_x"], args["bound_m"])
    ok = True
    for step in range(steps):
        everyone = [good(W, q, seed + step) for q in range(W)]
        for name in ("dp_x", "indices", "weights"):
            args[name][...] = xp.asarray(everyone[r][name])
        dispatch()
        combine()
        a2a.synchronize()
        ok = ok and right(everyone, r, args, out)
    return ok


def right(everyone, r, args, out):
    """Whether rank r's counts and out_tokens are the reference's for the ranks' arguments ``everyone``."""
    W = len(everyone)
    ref = reference.dispatch([a["dp_x"] for a in everyone], None, [a["indices"] for a in everyone],
                             E_PER_RANK * W, W, M)
    want = reference.combine([a["indices"] for a in everyone], [a["weights"] for a in everyone],
                             [q["expert_x"] for q in ref], [q["origin"] for q in ref], E_PER_RANK * W, W,
                             np.float16)[r]
    return (np.array_equal(host(args["out_expert_num_tokens"]), ref[r]["expert_num_tokens"])
            and np.allclose(host(out).astype(np.float32), want.astype(np.float32), rtol=2 ** -9, atol=1e-3))


BAD_DISPATCH = {  # argument -> a bad value of it (given by the last rank only)
    "out_expert_num_tokens": lambda a: xp.zeros(E_PER_RANK, np.int64),
    "out_expert_x": lambda a: xp.zeros((E_PER_RANK, 1, H), np.float16),
    "out_expert_x_scale": lambda a: xp.zeros((1,), np.float32),
    "dp_x": lambda a: a["dp_x"].astype(np.float32),
    "dp_x_scale": lambda a: xp.zeros((M, 1), np.float32),
    "indices": lambda a: a["indices"][:, :1].copy(),
    "bound_m": lambda a: xp.array([M], np.int64),
    "weights": lambda a: xp.zeros((M, K + 1), np.float32),
}
BAD_COMBINE = {
    "out_tokens": lambda a: xp.zeros((M, H), np.float32),
    "indices": lambda a: a["indices"].astype(np.int16),
    "weights": lambda a: xp.zeros((M, K), np.float64),
    "expert_y": lambda a: a["out_expert_x"][:1],
    "bound_m": lambda a: xp.zeros((2,), np.int32),
}
BAD_ROUTING = {  # dispatch argument -> a value the kernels (or the host transport) reject
    "indices": lambda a: a["indices"] + E_PER_RANK * 100,
    "bound_m": lambda a: xp.array([M + 1], np.int32),
}


class ReadOnly:
    """A device array seen through ``__cuda_array_interface__`` marked read-only (or a read-only numpy view)."""

    def __init__(self, a):
        self.a = a

    @property
    def __cuda_array_interface__(self):
        cai = dict(self.a.__cuda_array_interface__)
        cai["data"] = (cai["data"][0], True)
        return cai


def readonly(a):
    if isinstance(a, np.ndarray):
        v = a.view()
        v.flags.writeable = False
        return v
    return ReadOnly(a)


def conventions(comm, a2a, seed):
    """pplx-kernels' calls (per-token arrays sized on their own, uint32, weights at combine) and DeepEP's
    (int64 ids, -1 slots): failures as strings."""
    W, r, E = comm.world_size, comm.rank, E_PER_RANK * comm.world_size
    everyone = [good(W, q, seed) for q in range(W)]
    ms = [M - 1 - q % 3 for q in range(W)]
    for q, a in enumerate(everyone):  # DeepEP: int64 ids, some slots -1
        a["indices"] = a["indices"][:ms[q]].astype(np.int64)
        a["indices"][::3, 0] = -1
    ref = reference.dispatch([a["dp_x"][:ms[q]] for q, a in enumerate(everyone)], None,
                             [a["indices"] for a in everyone], E, W, M)
    want = reference.combine([a["indices"] for a in everyone], [a["weights"][:ms[q]] for q, a in enumerate(everyone)],
                             [q["expert_x"] for q in ref], [q["origin"] for q in ref], E, W, np.float16)[r]
    fails, mine = [], everyone[r]
    for name, ids in (("pplx (uint32 ids)", mine["indices"].astype(np.uint32)),
                      ("DeepEP (int64 ids)", mine["indices"])):
        args = on_device(dict(mine, indices=ids, bound_m=np.array([ms[r]], np.uint32), weights=None,
                              dp_x=mine["dp_x"][:ms[r] + 1]))  # each per-token array sized on its own
        a2a.dispatch(**args)
        out = xp.zeros((M, H), np.float16)  # max_num_tokens rows
        a2a.combine(out, args["indices"], xp.asarray(mine["weights"][:ms[r]]), args["out_expert_x"], args["bound_m"])
        a2a.synchronize()
        if not np.array_equal(host(args["out_expert_num_tokens"]), ref[r]["expert_num_tokens"]):
            fails.append(f"{name}: counts {host(args['out_expert_num_tokens'])}, want {ref[r]['expert_num_tokens']}")
        if not np.allclose(host(out)[:ms[r]].astype(np.float32), want.astype(np.float32), rtol=2 ** -9, atol=1e-3):
            fails.append(f"{name}: combined tokens differ from the reference")
    return fails


def expect(fails, label, steps, a2a, kinds, peer=None, limit=TIMEOUT):
    """Run the ``steps`` of a call, then ``a2a.synchronize()`` (unless a2a is None); record a failure unless
    one of them raises one of ``kinds`` (naming ``peer``) within ``limit`` seconds."""
    t0 = time.monotonic()
    try:
        for step in steps:
            step()
        if a2a is not None:
            a2a.synchronize()
    except kinds as e:
        took = time.monotonic() - t0
        if peer is not None and getattr(e, "peer", None) != peer:
            fails.append(f"{label}: {type(e).__name__} names peer {getattr(e, 'peer', None)}, expected {peer}: {e}")
        if took > limit:
            fails.append(f"{label}: raised after {took:.2f} s")
        return e
    except Exception as e:  # noqa: BLE001 - any other outcome is the failure being reported
        fails.append(f"{label}: raised {type(e).__name__}: {e}")
        return None
    fails.append(f"{label}: no error raised")
    return None


def replay_order(comm, a2a, again, fails):
    """The ``--replay`` case (module docstring): ``again`` "dispatch" or "combine" is replayed twice. The
    arrays are written on CuPy's current stream and the calls captured on another: a producer outside the
    capture is not waited for (CUDA would refuse the wait)."""
    import cupy
    W, r = comm.world_size, comm.rank
    if not roundtrip(comm, a2a, 700):  # eager first: the kernels are loaded before capture
        fails.append("the eager call before capture is wrong")
    everyone = [good(W, q, 701) for q in range(W)]
    args, out = on_device(everyone[r]), xp.zeros((M, H), np.float16)
    stream = cupy.cuda.Stream(non_blocking=True)
    calls = {"dispatch": lambda: a2a.dispatch(**args, stream=stream),
             "combine": lambda: a2a.combine(out, args["indices"], None, args["out_expert_x"], args["bound_m"],
                                            stream=stream)}
    cupy.cuda.Device().synchronize()
    graphs = {}
    with a2a.captured():
        for name, call in calls.items():
            stream.begin_capture(cupy.cuda.runtime.streamCaptureModeRelaxed)
            call()
            graphs[name] = stream.end_capture()
    for name in ("dispatch", "combine"):
        graphs[name].launch(stream)
    stream.synchronize()
    a2a.check()
    ref = reference.dispatch([a["dp_x"] for a in everyone], None, [a["indices"] for a in everyone],
                             E_PER_RANK * W, W, M)
    want = reference.combine([a["indices"] for a in everyone], [a["weights"] for a in everyone],
                             [q["expert_x"] for q in ref], [q["origin"] for q in ref], E_PER_RANK * W, W,
                             np.float16)[r]
    if not np.allclose(host(out).astype(np.float32), want.astype(np.float32), rtol=2 ** -9, atol=1e-3):
        fails.append("the replayed call is wrong")
    out.fill(7)
    cupy.cuda.Device().synchronize()

    def replay():  # a dispatch after a whole call is the next call: twice, the second meets no combine
        for _ in range(2 if again == "dispatch" else 1):
            graphs[again].launch(stream)
        stream.synchronize()
        a2a.check()
    e = expect(fails, f"{again} replayed twice", [replay], None, moecomm.OutOfStep)
    if e is not None and again not in str(e):
        fails.append(f"OutOfStep does not name the {again}: {e}")
    if again == "combine" and not unwritten(out, 7):
        fails.append("a combine replayed twice wrote plausible rows into out_tokens")
    expect(fails, "a call after the replay out of order", [calls["dispatch"]], None, moecomm.CommBroken)
    return 4


def main():
    global xp
    p = argparse.ArgumentParser()
    p.add_argument("--transport", default="host")
    p.add_argument("--replay", choices=("dispatch", "combine"),
                   help="only the case of that call replayed twice from a CUDA graph (GPU transports)")
    opts = p.parse_args()
    transport = opts.transport
    comm = moecomm.init(transport=transport, timeout=TIMEOUT)
    if transport != "host":
        import cupy
        xp = cupy
    W, r, last = comm.world_size, comm.rank, comm.world_size - 1
    fails, checks = [], 0
    a2a = moecomm.AllToAll(comm, M, E_PER_RANK * W, K, H, None, "fp16" if r % 2 else np.float16, "float16")
    checks += 1  # the spellings of one configuration were accepted as equal
    if opts.replay:
        checks += replay_order(comm, a2a, opts.replay, fails)
        comm.finalize()
        from mpi4py import MPI
        sys.exit(report(MPI.COMM_WORLD.allgather(fails), checks, W, r))

    def out():
        return xp.zeros((M, H), np.float16)

    def whole_call(args, cargs=None):
        """The steps of one call: dispatch with ``args``, then combine (``cargs`` or the defaults)."""
        c = cargs or dict(out_tokens=out(), indices=args["indices"], weights=None, expert_y=args["out_expert_x"],
                          bound_m=args["bound_m"])
        return [lambda: a2a.dispatch(**args), lambda: a2a.combine(**c)]

    # a bad argument at each position: collective, and the next call is right
    for i, (name, bad) in enumerate(BAD_DISPATCH.items()):
        args = on_device(good(W, r, i))
        if r == last:
            args[name] = bad(args)
            expect(fails, f"dispatch with a bad {name}", [lambda: a2a.dispatch(**args)], None,
                   moecomm.InvalidArgument)
        else:
            expect(fails, f"dispatch with a bad {name} on rank {last}", whole_call(args), a2a, moecomm.PeerError, last)
        if not roundtrip(comm, a2a, 100 + i):
            fails.append(f"the call after a bad dispatch {name} is wrong")
        checks += 1
    for i, (name, bad) in enumerate(BAD_COMBINE.items()):
        args = on_device(good(W, r, 200 + i))
        a2a.dispatch(**args)
        cargs = dict(out_tokens=out(), indices=args["indices"], weights=None, expert_y=args["out_expert_x"],
                     bound_m=args["bound_m"])
        if name == "weights":
            cargs["weights"] = args["weights"]
        if r == last:
            cargs[name] = bad(args)
            expect(fails, f"combine with a bad {name}", [lambda: a2a.combine(**cargs)], None, moecomm.InvalidArgument)
        else:
            expect(fails, f"combine with a bad {name} on rank {last}", [lambda: a2a.combine(**cargs)], a2a,
                   moecomm.PeerError, last)
        if not roundtrip(comm, a2a, 300 + i):
            fails.append(f"the call after a bad combine {name} is wrong")
        checks += 1

    if not prepared_steps(comm, a2a, 900):
        fails.append("prepared calls whose inputs change in place each step are wrong")
    checks += 1

    # bad routing on the last rank: InvalidRouting everywhere by the end of the call
    for i, (name, bad) in enumerate(BAD_ROUTING.items()):
        args = on_device(good(W, r, 350 + i))
        if r == last:
            args[name] = bad(args)
        before = xp.full((M, H), 7, np.float16)  # the failed rank's combine writes nothing plausible there
        cargs = dict(out_tokens=before, indices=args["indices"], weights=None, expert_y=args["out_expert_x"],
                     bound_m=args["bound_m"])
        expect(fails, f"dispatch with a bad {name} value on rank {last}", whole_call(args, cargs), a2a,
               moecomm.InvalidRouting)
        if r == last and not unwritten(before, 7):
            fails.append(f"the call with a bad {name} value wrote plausible rows into out_tokens on the rank that "
                         f"failed")
        if not roundtrip(comm, a2a, 360 + i):
            fails.append(f"the call after bad routing ({name}) is wrong")
        checks += 1

    # combine with another m than the dispatch's, on the last rank
    args = on_device(good(W, r, 400))
    a2a.dispatch(**args)
    m = xp.array([M - 1 if r == last else M], np.int32)
    expect(fails, "combine with another bound_m",
           [lambda: a2a.combine(out(), args["indices"], None, args["out_expert_x"], m)], a2a,
           moecomm.InvalidArgument if r == last else moecomm.PeerError, None if r == last else last)
    if not roundtrip(comm, a2a, 401):
        fails.append("the call after a combine with another bound_m is wrong")
    checks += 1

    # an output the last rank cannot write; an out_tokens shorter than m on the last rank
    args = on_device(good(W, r, 450))
    if r == last:
        args["out_expert_x"] = readonly(args["out_expert_x"])
        expect(fails, "dispatch into a read-only out_expert_x", [lambda: a2a.dispatch(**args)], None,
               moecomm.InvalidArgument)
    else:
        expect(fails, f"dispatch into a read-only out_expert_x on rank {last}", whole_call(args), a2a,
               moecomm.PeerError, last)
    if not roundtrip(comm, a2a, 451):
        fails.append("the call after a read-only output is wrong")
    args = on_device(good(W, r, 452))
    short = dict(out_tokens=xp.zeros((M - 2 if r == last else M, H), np.float16), indices=args["indices"], weights=None,
                 expert_y=args["out_expert_x"], bound_m=args["bound_m"])
    expect(fails, f"combine into an out_tokens shorter than m on rank {last}", whole_call(args, short), a2a,
           moecomm.InvalidRouting)
    if not roundtrip(comm, a2a, 453):
        fails.append("the call after a short out_tokens is wrong")
    checks += 2

    # a repeated expert id on the last rank, raised by synchronize() before any combine: the call is over
    args = on_device(good(W, r, 470))
    if r == last:
        args["indices"][:, 1] = args["indices"][:, 0]
    e = expect(fails, f"synchronize() after a dispatch with a repeated expert id on rank {last}",
               [lambda: a2a.dispatch(**args)], a2a, (moecomm.InvalidRouting, moecomm.PeerError))
    if e is not None and transport == "host" and not isinstance(e, moecomm.InvalidRouting):
        fails.append(f"the host transport raised {type(e).__name__} for bad routing: {e}")
    if not roundtrip(comm, a2a, 471):
        fails.append("the dispatch after an error raised by synchronize() is refused or wrong")
    checks += 1

    fails += conventions(comm, a2a, 480)
    checks += 4

    # every rank dispatches twice without combining: the second dispatch ends the first call (saying so) and
    # runs as the next one
    args = on_device(good(W, r, 500))
    a2a.dispatch(**args)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if not roundtrip(comm, a2a, 501):
            fails.append("the call of a dispatch that ended an uncombined one is wrong")
    if not any("was not finished" in str(w.message) for w in seen):
        fails.append(f"a dispatch that ended an uncombined call gave no warning: {[str(w.message) for w in seen]}")
    checks += 1

    # construction with a bad argument on the last rank
    expect(fails, "AllToAll with a bad hidden_dim on one rank",
           [lambda: moecomm.AllToAll(comm, M, E_PER_RANK * W, K, H + (1 if r == last else 0), None, "fp16", "fp16")],
           None, moecomm.InvalidArgument)
    checks += 1
    if W > 1:  # what only ranks that disagree can do (one rank runs the checks above: the local path on GPUs)
        # a valid configuration that differs on the last rank
        e = expect(fails, "AllToAlls whose max_num_tokens differs on one rank",
                   [lambda: moecomm.AllToAll(comm, M + (8 if r == last else 0), E_PER_RANK * W, K, H, None, "fp16",
                                             "fp16")],
                   None, moecomm.InvalidArgument)
        if e is not None and ("max_num_tokens=" not in str(e) or "hidden_dim" in str(e)):
            fails.append(f"the message does not name just the field that differs: {e}")
        # two AllToAlls in different orders on different ranks
        b2b = moecomm.AllToAll(comm, M, E_PER_RANK * W, K, H, None, "fp16", "fp16")
        first = b2b if r == last else a2a
        args = on_device(good(W, r, 600))
        steps = [lambda: first.dispatch(**args),
                 lambda: first.combine(out(), args["indices"], None, args["out_expert_x"], args["bound_m"])]
        e = expect(fails, "AllToAlls called in different orders", steps, first,
                   (moecomm.OutOfStep, moecomm.CommTimeout), limit=TIMEOUT + 1)
        if isinstance(e, moecomm.OutOfStep) and "AllToAll #" not in str(e):
            fails.append(f"OutOfStep does not say which calls met: {e}")
        expect(fails, "a call on a broken communicator", [lambda: a2a.dispatch(**args)], None, moecomm.CommBroken)
        checks += 3
    t0 = time.monotonic()
    comm.finalize()  # broken (more than one rank): local only, no wait; one rank: a healthy one's finalize
    if W > 1 and time.monotonic() - t0 > 0.5:
        fails.append(f"finalize of a broken communicator took {time.monotonic() - t0:.2f} s")

    # report over plain MPI (the communicator is broken by design here)
    from mpi4py import MPI
    sys.exit(report(MPI.COMM_WORLD.allgather(fails), checks, W, r))


if __name__ == "__main__":
    main()
