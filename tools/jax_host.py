"""Host time of moecomm.jax's dispatch and combine inside a jitted step, one GPU (world size 1), R1 shapes in
bfloat16 (128 tokens, 7168 hidden, 256 experts, top-8; router weights sent with dispatch).

    python tools/jax_host.py [--steps 300] [--json jax-host.json]

The step ``dispatch -> combine`` (expert outputs = the dispatched tokens) runs under ``jax.jit``; XLA calls
moecomm's FFI handlers on its host thread where it runs the calls outside a command buffer (where it replays
a command buffer, none runs: ``n`` 0). Each handler's own time is timed inside it: moecomm.jax's reading of
XLA's buffers (``_array``) and the call itself (``AllToAll.run``: checks, launch), each and their sum per
call. The step's wall time (one step, then its wait) comes beside it. The
output of the first step is checked against moecomm.reference. Medians and p99 over ``--steps`` steps.
"""
import argparse
import json
import os
import platform
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # CuPy and JAX share the GPU

import numpy as np  # noqa: E402

import moecomm  # noqa: E402
from moecomm import reference  # noqa: E402


def summary(us):
    """Median, p99 and count of ``us`` (NaN where there is none: XLA replayed its command buffers, no handler
    ran)."""
    us = np.asarray(us, float)
    if not us.size:
        return {"median_us": float("nan"), "p99_us": float("nan"), "n": 0}
    return {"median_us": float(np.median(us)), "p99_us": float(np.percentile(us, 99)), "n": int(us.size)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="timed steps (default 300)")
    p.add_argument("--transport", default="ipc", choices=["ipc", "nvshmem", "host"], help="transport (default ipc)")
    p.add_argument("--json", default="jax-host.json", help="output JSON (default jax-host.json)")
    p.add_argument("--parts", action="store_true", help="also time each step of AllToAll.run (each wrapped)")
    args = p.parse_args()
    comm = moecomm.init(transport=args.transport)
    import jax
    import jax.numpy as jnp

    from moecomm import jax as moecomm_jax  # after init, as a program may import it
    M, E, K, H = 128, 256, 8, 7168
    a2a = moecomm.AllToAll(comm, M, E, K, H, None, "bfloat16", "bfloat16")
    layer = moecomm_jax.AllToAll(a2a)
    spent = {"buffer": 0.0}  # seconds reading XLA's buffers since the last callback ended
    calls = []  # [(phase, microseconds reading buffers, microseconds in run())] per callback
    steps = {}  # --parts: {step of run(): [microseconds per call]}

    def wrap(owner, name, after):
        """Replace owner.name (an instance attribute, which the callers look up) by a wrapper that passes its
        seconds and arguments to ``after``."""
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                after(time.perf_counter() - t0, a)
        setattr(owner, name, wrapper)

    def read(seconds, _):
        spent["buffer"] += seconds

    def ran(seconds, a):  # run() ends a callback: its reads came just before it
        calls.append((a[0].phase, 1e6 * spent["buffer"], 1e6 * seconds))
        spent["buffer"] = 0.0
    wrap(layer, "_array", read)
    wrap(a2a, "run", ran)
    if args.parts:  # the steps of AllToAll.run, each timed on its own
        for owner, name, label in ((a2a._context, "enter", "context enter"), (a2a._arrays, "begin", "arrays.begin"),
                                   (a2a, "_read", "read and check the arrays"), (a2a._order, "advance", "call order"),
                                   (a2a._backend, "dispatch", "backend.dispatch (launch)"),
                                   (a2a._backend, "combine", "backend.combine (launch, error word)")):
            if owner is not None:
                wrap(owner, name, lambda seconds, _, label=label: steps.setdefault(label, []).append(1e6 * seconds))

    @jax.jit
    def step(x, idx, m, w):
        _, ex, _ = layer.dispatch(x, None, idx, m, w)
        return layer.combine(idx, None, ex, m)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((M, H), np.float32).astype(moecomm.bfloat16)
    idx = np.argsort(rng.random((M, E)), axis=1)[:, :K].astype(np.int32)
    w = rng.random((M, K), np.float32)
    dev = jax.devices()[comm.device if a2a.comm.transport.memory == "device" else 0]
    args_dev = [jax.device_put(a, dev) for a in (x, idx, np.array([M], np.int32), w)]
    out = np.asarray(step(*args_dev).astype(jnp.float32))
    ref = reference.dispatch([x], None, [idx], E, 1, M)[0]
    want = reference.combine([idx], [w], [ref["expert_x"]], [ref["origin"]], E, 1, moecomm.bfloat16)[0]
    if not np.allclose(out, want.astype(np.float32), rtol=2 ** -7, atol=1e-2):
        raise SystemExit("jax_host.py: the jitted step's output differs from moecomm.reference")
    for _ in range(20):
        step(*args_dev).block_until_ready()
    calls.clear()
    steps.clear()
    wall = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step(*args_dev).block_until_ready()
        wall.append(1e6 * (time.perf_counter() - t0))
    per_phase = {ph: {"total": summary([b + r for q, b, r in calls if q == ph]),
                      "buffers": summary([b for q, b, _ in calls if q == ph]),
                      "run": summary([r for q, _, r in calls if q == ph])} for ph in ("dispatch", "combine")}
    result = {"command": "python tools/jax_host.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()
                                                                  if k not in ("json", "parts"))
                                                       + (" --parts" if args.parts else ""),
              "environment": {"host": platform.node(), "python": platform.python_version(), "jax": jax.__version__,
                              "device": str(dev)},
              "moecomm_host_us": per_phase, "step_wall_us": summary(wall),
              "run_steps_us": {label: summary(us) for label, us in steps.items()}}
    for ph, s in per_phase.items():
        print(f"moecomm.jax {ph}: {s['total']['median_us']:.1f} us inside moecomm per call (p99 "
              f"{s['total']['p99_us']:.1f}): reading XLA's buffers {s['buffers']['median_us']:.1f}, "
              f"AllToAll.run {s['run']['median_us']:.1f}")
    print(f"jitted dispatch + combine step, one at a time: {result['step_wall_us']['median_us']:.1f} us")
    for label, v in result["run_steps_us"].items():
        print(f"  {v['median_us']:7.1f} us  {label}")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    a2a.destroy()
    comm.finalize()


if __name__ == "__main__":
    main()
