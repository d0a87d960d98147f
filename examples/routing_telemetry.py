"""Routing telemetry and a replica plan: run skewed steps, gather every rank's ``a2a.stats()`` (kept by the
kernels on GPUs: the window of per-step counts, drops, bytes per peer, phase times), print the operator's
metrics, write them as Prometheus text, and plan replicas for the observed load.

    mpiexec -n 2 python examples/routing_telemetry.py [--steps 50] [--prom routing.prom]
    mpirun -np 2 python examples/routing_telemetry.py          # on GPUs (CuPy arrays)

Routing: a Zipf popularity over the experts whose hottest expert moves every 20 steps (a tenant or time of
day changing what is hot).
"""
import argparse

import numpy as np

import moecomm
from moecomm import balance, telemetry


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50, help="routing steps (default 50)")
    p.add_argument("--prom", default="routing.prom", help="Prometheus text output (rank 0; needs prometheus_client)")
    args = p.parse_args()
    comm = moecomm.init()
    xp = np
    if comm.transport.memory == "device":
        import cupy as xp
    W, r = comm.world_size, comm.rank
    E, K, H, M = 16 * W, 4, 256, 64
    L = E // W
    a2a = moecomm.AllToAll(comm, M, E, K, H, None, "bfloat16", "bfloat16", telemetry_window=args.steps, timing=True)
    rng = np.random.default_rng(r)
    for step in range(args.steps):
        hot = (step // 20) * 5 % E  # the hottest expert moves
        p_e = np.roll(1.0 / np.arange(1, E + 1) ** 1.1, hot)
        idx = np.stack([rng.choice(E, K, replace=False, p=p_e / p_e.sum()) for _ in range(M)]).astype(np.int32)
        n = xp.zeros(L, np.int32)
        ex = xp.zeros((L, M * W, H), np.uint16 if xp is not np else moecomm.bfloat16)
        x = xp.zeros((M, H), ex.dtype)
        d_idx, m = xp.asarray(idx), xp.array([M], np.int32)
        a2a.dispatch(n, ex, None, x, None, d_idx, m, weights=xp.ones((M, K), np.float32),
                     call_id=xp.array([step], np.int32))  # a rank that skipped a step: OutOfStep, not wrong pairs
        a2a.combine(xp.zeros((M, H), ex.dtype), d_idx, None, ex, m)
    snapshots = comm.allgather(a2a.stats())  # the one synchronizing call
    if r == 0:
        m = telemetry.from_stats(snapshots, hot_factor=2.0)
        window = np.concatenate([s["window"] for s in snapshots], axis=1)  # [steps, E]: rank r's experts at r*L
        share = np.array(m["expert"]["share"])
        print(f"{m['steps']} steps, {m['pairs']} (token, expert) pairs over {E} experts on {W} ranks")
        print(f"imbalance max/mean rank load per step: mean {m['imbalance']['mean']:.2f}, "
              f"p95 {m['imbalance']['p95']:.2f}, max {m['imbalance']['max']:.2f}")
        top = np.argsort(-share)[:4]
        print("hottest experts: " + ", ".join(
            f"{e} ({share[e]:.1%}, max {m['expert']['max'][e]}/step, hot streak {m['hot']['longest_streak'][e]})"
            for e in top))
        t = m["time_us"]
        print(f"bytes sent: dispatch {m['bytes']['dispatch_sent']}, combine {m['bytes']['combine_sent']}; "
              f"time per call (slowest rank): dispatch median {t['dispatch']['median']:.0f} us, combine "
              f"{t['combine']['median']:.0f} us")
        try:
            with open(args.prom, "wb") as f:
                f.write(telemetry.to_prometheus(m, labels={"layer": "0"}))
            print(f"wrote {args.prom}")
        except moecomm.InvalidArgument as e:
            print(f"no Prometheus text: {e}")
        load = window[-20:].mean(axis=0)  # the last 20 steps
        static = balance.ExpertMap.static(E, W, slots_per_rank=L + 2)
        planned = balance.plan(load, W, L + 2, previous=static)
        print(f"replicas for the last 20 steps, {L + 2} slots per rank: predicted imbalance "
              f"{static.imbalance(load):.2f} static -> {planned.imbalance:.2f} planned "
              f"(largest rank load {planned.gap:.2f}x its lower bound, {planned.moves} replicas to copy)")
    a2a.destroy()
    comm.finalize()


if __name__ == "__main__":
    main()
