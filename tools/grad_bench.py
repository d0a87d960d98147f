"""The backward calls against the forward ones at the same shapes: CUDA-graph replays of dispatch and combine,
then of combine_backward and dispatch_backward (the order a training step runs them), each phase timed with
CUDA events (medians and p99 over --iters replays after --warmup, max over ranks), and the same calls eagerly;
any world size (tokens per rank as the configuration says). Before timing, every rank's gradients of this
routing are checked against numpy (the slots the plan holds; the empty ones must stay as they were, zeros).
Each result holds forward_us, backward_us and ratio (graph medians: dispatch + combine, combine_backward +
dispatch_backward); at world size 1 also ``floor``: each phase's memory pattern alone (tools/hbm_floor.py's
plain kernels over the same slots), each in its own graph timed in the same loop, so that a phase's figure
and its floor carry the same graph launch.

    mpirun -np 1 python tools/grad_bench.py --transport ipc --configs r1-decode r1-prefill-cap256 --json grad-ws1.json
    mpirun -np 2 python tools/grad_bench.py ...     (EP2: a GPU per rank)

Configurations: name -> (tokens, experts, top-k, hidden, scales, capacity); fp8 tokens with float32 scales,
bf16 expert outputs, bf16 gradients, router weights at combine; capacity None is the worst case.
"""
import argparse
import json
import sys

import numpy as np

import moecomm
from moecomm.bench import environment, routing, stats

CONFIGS = {
    "r1-decode": (128, 256, 8, 7168, 56, None),
    "r1-decode-cap32": (128, 256, 8, 7168, 56, 32),
    "r1-prefill-cap256": (4096, 256, 8, 7168, 56, 256),
}


def buffer(cp, a, dtype):
    """A DeviceBuffer of CuPy array ``a`` read as ``dtype``."""
    return moecomm.DeviceBuffer(a.data.ptr, a.shape, np.dtype(dtype), a.data.device_id, a)


def run(comm, name, args):
    import cupy as cp
    T, E, K, H, S, cap = CONFIGS[name]
    W, r = comm.world_size, comm.rank
    bf16 = moecomm.bfloat16
    a2a = moecomm.AllToAll(comm, T, E, K, H, S, "float8_e4m3fn", "bfloat16", capacity=cap, gradients=True)
    c = a2a.cfg
    shape, L = c.expert_x_shape(), c.num_local_experts
    rng = np.random.default_rng([7, r])
    ids = routing(rng, T, K, E, "uniform")
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        u16 = lambda a: cp.asarray(np.asarray(a, np.float32).astype(bf16).view(np.uint16))  # noqa: E731
        d = dict(x=cp.asarray(rng.integers(0, 255, (T, H), np.uint8) & 0x77),
                 xs=cp.asarray(rng.random((T, S), np.float32)), idx=cp.asarray(ids),
                 w=cp.asarray(rng.random((T, K), np.float32)), m=cp.asarray(np.array([T], np.int32)),
                 n=cp.zeros(L, np.int32), ex=cp.zeros(shape, np.uint8), es=cp.zeros(shape[:-1] + (S,), np.float32),
                 out=cp.zeros((T, H), np.uint16), gout=u16(rng.standard_normal((T, H))),
                 gx=cp.zeros((T, H), np.uint16), gw=cp.zeros((T, K), np.float32))
        d["y"] = cp.empty(shape, np.uint16)
        d["y"][...] = cp.arange(H, dtype=np.uint16) % 251 + 0x3C00  # finite bf16 (1..2)
        values = (cp.arange(int(np.prod(shape)), dtype=np.uint32).reshape(shape) % 509).astype(np.float32) / 256 - 1
        d["gex"] = (values.view(np.uint32) >> 16).astype(np.uint16)  # bf16 (float32 truncated): -1 .. 1
        d["gy"] = cp.zeros(shape, np.uint16)
        plan = moecomm.RoutingPlan(*(cp.zeros(p, np.int32) for p in a2a.plan_shapes()))
        B = {k: buffer(cp, v, bf16) for k, v in d.items() if k in ("y", "out", "gout", "gx", "gex", "gy")}

        def dispatch():
            a2a.dispatch(d["n"], d["ex"], d["es"], d["x"], d["xs"], d["idx"], d["m"], stream=s)

        def combine():
            a2a.combine(B["out"], d["idx"], d["w"], B["y"], d["m"], stream=s)

        def combine_backward():
            a2a.combine_backward(B["gy"], d["gw"], plan, B["gout"], d["w"], B["y"], d["m"], stream=s)

        def dispatch_backward():
            a2a.dispatch_backward(B["gx"], plan, B["gex"], d["m"], stream=s)

        dispatch()
        a2a.plan(plan, s)
        combine()
        combine_backward()
        dispatch_backward()
        a2a.synchronize(s)
        fails = [f for rank in comm.allgather(check(comm, d, plan, T, K, H)) for f in rank]
        phases = {"dispatch": dispatch, "combine": combine, "combine_backward": combine_backward,
                  "dispatch_backward": dispatch_backward}
        patterns = floor_patterns(cp, d, plan, T, K, H) if W == 1 else {}
        graphs = {}
        for p, fn in {**phases, **{"floor_" + k: f for k, f in patterns.items()}}.items():
            s.begin_capture(cp.cuda.runtime.streamCaptureModeRelaxed)
            fn()
            graphs[p] = s.end_capture()
        graph = timed(cp, s, list(graphs.values()), args, comm)
        eager = timed(cp, s, list(phases.values()), args, comm, eager=True)
    a2a.destroy()
    out = {"config": name, "tokens": T, "experts": E, "topk": K, "hidden": H, "scales": S,
           "capacity": c.expert_capacity, "world_size": W, "transport": comm.transport.name, "check_failures": fails}
    names = list(phases)
    if patterns:  # the memory patterns alone, each in its graph timed beside the phases' (world size 1)
        t = graph[:, len(names):]
        out["floor"] = {k: stats(t[:, i]) for i, k in enumerate(patterns)}
        out["floor"]["forward"] = stats(t[:, 0] + t[:, 1])
        out["floor"]["backward"] = stats(t[:, 2] + t[:, 3])
    for kind, t in (("graph", graph), ("eager", eager)):
        out[kind] = {n: stats(t[:, i]) for i, n in enumerate(names)}
        out[kind]["forward"] = stats(t[:, 0] + t[:, 1])
        out[kind]["backward"] = stats(t[:, 2] + t[:, 3])
        out[kind]["backward_over_forward"] = out[kind]["backward"]["median_us"] / out[kind]["forward"]["median_us"]
    g = out["graph"]  # the figures the target reads: graph medians
    out.update(forward_us=g["forward"]["median_us"], backward_us=g["backward"]["median_us"],
               ratio=g["backward_over_forward"])
    return out


def floor_patterns(cp, d, plan, T, K, H):
    """{phase: a launch of its memory pattern alone} at world size 1 (tools/hbm_floor.py's plain grid-stride
    kernels, over this routing's slots, plan.local): dispatch writes each token row (fp8) into its slots'
    rows, combine sums a token's slot rows (bf16), combine_backward reads a token's grad_out row and its slots'
    expert_y rows and writes their gradients, dispatch_backward sums a token's slot gradients. The bytes each
    phase must move, less its scales, ids and weights."""
    from hbm_floor import KERNELS
    mod = cp.RawModule(code=KERNELS)
    fanout, wsum, scale_dot = (mod.get_function(k) for k in ("fanout", "wsum", "scale_dot"))
    grid, threads = (8 * cp.cuda.Device().attributes["MultiProcessorCount"],), (256,)
    slots, sink = plan.local, cp.zeros(1, np.float32)
    x, y = H // 16, 2 * H // 16  # 16-byte chunks of an fp8 and of a bf16 row
    T, K = np.int64(T), np.int32(K)
    return {"dispatch": lambda: fanout(grid, threads, (d["x"], d["ex"], slots, T, np.int32(x), K)),
            "combine": lambda: wsum(grid, threads, (d["y"], d["out"], slots, T, np.int32(y), K)),
            "combine_backward": lambda: scale_dot(grid, threads, (d["gout"], d["y"], d["gy"], slots, T,
                                                                  np.int32(y), K, sink)),
            "dispatch_backward": lambda: wsum(grid, threads, (d["gex"], d["gx"], slots, T, np.int32(y), K))}


def timed(cp, s, fns, args, comm, eager=False):
    """[iters, len(fns)] microseconds of each of ``fns`` (graphs, or eager calls) in turn, max over ranks."""
    ev = [cp.cuda.Event() for _ in range(len(fns) + 1)]
    t = []
    for it in range(args.warmup + args.iters):
        comm.transport.barrier(s.ptr)
        ev[0].record(s)
        for i, f in enumerate(fns):
            f() if eager else f.launch(s)
            ev[i + 1].record(s)
        ev[-1].synchronize()
        if it >= args.warmup:
            t.append([cp.cuda.get_elapsed_time(ev[i], ev[i + 1]) * 1e3 for i in range(len(fns))])
    return np.max(np.stack(comm.allgather(np.asarray(t))), axis=0)


def check(comm, d, plan, T, K, H):
    """This rank's gradients against numpy, from every rank's plan and arrays: its tokens' (the slots of every
    rank holding them) and its slots' (the source rank's weights and grad_out); the empty slots must stay as
    they were, zeros."""
    bf = moecomm.bfloat16
    r = comm.rank
    origin = plan.origin.get().reshape(-1, 3)
    slots = np.nonzero(origin[:, 0] >= 0)[0]
    src, t, k = origin[slots].T
    rows = lambda a: a.get().reshape(-1, H)[slots]  # noqa: E731 (bf16 bits of the held slots)
    held = comm.allgather((src, t, k, rows(d["gex"]), rows(d["y"])))
    gout, w = d["gout"].get().view(bf).astype(np.float32), d["w"].get()
    tokens = comm.allgather((w, d["gout"].get()))
    want_x, want_w = np.zeros((T, H), np.float32), np.zeros((T, K), np.float32)
    for q_src, q_t, q_k, q_gex, q_y in held:  # every rank's slots of this rank's tokens
        mine = q_src == r
        np.add.at(want_x, q_t[mine], q_gex[mine].view(bf).astype(np.float32))
        want_w[q_t[mine], q_k[mine]] = np.einsum("ph,ph->p", gout[q_t[mine]], q_y[mine].view(bf).astype(np.float32))
    fails = []
    got_x = d["gx"].get().view(bf).astype(np.float32)
    if not np.allclose(got_x, want_x, rtol=2 ** -7, atol=1e-2):
        fails.append("dispatch_backward")
    gy = d["gy"].get().reshape(-1, H)
    source_w = np.stack([a for a, _ in tokens])[src, t, k]
    source_g = np.stack([b for _, b in tokens])[src, t].view(bf).astype(np.float32)
    if not np.array_equal(gy[slots].view(bf), (source_w[:, None] * source_g).astype(bf)):
        fails.append("combine_backward grad_expert_y")
    empty = np.ones(gy.shape[0], bool)
    empty[slots] = False
    if gy[empty].any():
        fails.append("combine_backward wrote empty slots")
    if not np.allclose(d["gw"].get(), want_w, rtol=1e-3, atol=1e-2):
        fails.append("combine_backward grad_weights")
    if int((d["n"].get()).sum()) != slots.size:
        fails.append(f"plan: {slots.size} slots, {int(d['n'].get().sum())} received")
    return [f"rank {r}: {f}" for f in fails]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transport", default=None, choices=["ipc", "nvshmem"], help="GPU transport (default: auto)")
    p.add_argument("--configs", nargs="+", default=["r1-decode", "r1-decode-cap32", "r1-prefill-cap256"],
                   choices=sorted(CONFIGS), help="configurations to time (default: the three listed first)")
    p.add_argument("--iters", type=int, default=300, help="timed replays per phase (default 300)")
    p.add_argument("--warmup", type=int, default=30, help="untimed replays first (default 30)")
    p.add_argument("--json", default=None, help="write the figures here (rank 0; default: none)")
    args = p.parse_args(argv)
    comm = moecomm.init(transport=args.transport)
    results = [run(comm, n, args) for n in args.configs]
    if comm.rank == 0:
        for res in results:
            g, e = res["graph"], res["eager"]
            print(f"{res['config']}: graph forward {g['forward']['median_us']:.1f} us, backward "
                  f"{g['backward']['median_us']:.1f} us ({g['backward_over_forward']:.2f}x; "
                  + ", ".join(f"{n} {g[n]['median_us']:.1f}" for n in ("dispatch", "combine", "combine_backward",
                                                                         "dispatch_backward"))
                  + f"); eager forward {e['forward']['median_us']:.1f}, backward {e['backward']['median_us']:.1f}; "
                  f"check failures: {res['check_failures']}")
            if "floor" in res:
                fl = res["floor"]
                print(f"  memory patterns alone, graphs: forward {fl['forward']['median_us']:.1f} us, backward "
                      f"{fl['backward']['median_us']:.1f} us (" + ", ".join(
                          f"{n} {fl[n]['median_us']:.1f}" for n in ("dispatch", "combine", "combine_backward",
                                                                    "dispatch_backward")) + ")")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"command": " ".join(sys.argv), "environment": environment(), "results": results}, f,
                          indent=1)
    comm.finalize()
    return 0 if all(not r["check_failures"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
