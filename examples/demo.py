"""The main job: one MoE layer's dispatch -> experts -> combine across ranks, checked against numpy.

    mpiexec -n 2 python examples/demo.py            # CPU ranks (host transport)
    mpirun -np 2 python examples/demo.py            # one GPU per rank (NVSHMEM)

Each rank routes its tokens to the top-k of the experts (a skewed router: expert 0 is hot), dispatches
them with their router weights, runs every local expert as a small matrix product, and combines. Rank 0
prints the tokens each expert received and whether the result matches the numpy reference.
"""
import argparse
import time

import numpy as np

import moecomm
from moecomm import reference


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transport", default="auto", choices=["auto", "host", "nvshmem", "ipc"],
                   help="transport (default auto: a GPU transport where there are GPUs)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=512, help="hidden size (default 512)")
    p.add_argument("--experts-per-rank", type=int, default=4, help="experts on each rank (default 4)")
    p.add_argument("--topk", type=int, default=2, help="experts per token (default 2)")
    args = p.parse_args()

    comm = moecomm.init(transport=args.transport)
    W, rank, M, H, K = comm.world_size, comm.rank, args.tokens, args.hidden, args.topk
    E = args.experts_per_rank * W
    L = E // W
    dt = moecomm.float16  # float16 in and out: the expert matmul runs natively in numpy and CuPy
    a2a = moecomm.AllToAll(comm, M, E, K, H, None, dt, dt)

    # every rank draws the same global data, so each can build the reference on its own
    rng = np.random.default_rng(0)
    x = [(rng.standard_normal((M, H)) * 0.5).astype(dt) for _ in range(W)]
    logits = rng.standard_normal((W, M, E)) + np.where(np.arange(E) == 0, 2.0, 0.0)  # expert 0 is hot
    idx = [np.argsort(-lg, axis=1)[:, :K].astype(np.int32) for lg in logits]
    w = [rng.dirichlet(np.ones(K), M).astype(np.float32) for _ in range(W)]
    experts = (rng.standard_normal((E, H, H)) / np.sqrt(H)).astype(dt)

    if comm.transport.memory == "host":
        xp, put, get = np, np.asarray, np.asarray
    else:
        import cupy as xp
        put, get = xp.asarray, xp.asnumpy
    counts = put(np.zeros(L, np.int32))
    expert_x = put(np.zeros((L, M * W, H), dt))
    out = put(np.zeros((M, H), dt))
    bound_m = put(np.array([M], np.int32))
    my_w = put(experts[rank * L:(rank + 1) * L])

    t0 = time.perf_counter()
    a2a.dispatch(counts, expert_x, None, put(x[rank]), None, put(idx[rank]), bound_m, weights=put(w[rank]))
    n = get(counts)
    expert_y = xp.zeros_like(expert_x)
    for le in range(L):  # the experts: one matrix product each over the tokens they received
        expert_y[le, :n[le]] = xp.matmul(expert_x[le, :n[le]], my_w[le])
    a2a.combine(out, put(idx[rank]), None, expert_y, bound_m)
    result = get(out)
    elapsed = time.perf_counter() - t0

    ref = reference.dispatch(x, None, idx, E, W, M)
    ref_y = [np.stack([(r["expert_x"][le].astype(np.float32) @ experts[q * L + le].astype(np.float32)).astype(dt)
                       for le in range(L)]) for q, r in enumerate(ref)]
    want = reference.combine(idx, w, ref_y, [r["origin"] for r in ref], E, W, dt)[rank]
    err = np.abs(result.astype(np.float32) - want.astype(np.float32)).max() / np.abs(want).max()
    ok = bool(np.array_equal(n, ref[rank]["expert_num_tokens"]) and err < 1e-2)
    summary = comm.allgather((n.tolist(), ok, float(err), elapsed))
    if rank == 0:
        print(f"moecomm demo: {W} ranks, transport {comm.transport.name}, {M} tokens/rank, hidden {H}, "
              f"{E} experts, top-{K}, router weights sent with dispatch")
        for r, (cnt, good, e, t) in enumerate(summary):
            print(f"  rank {r}: tokens per local expert {cnt}  combine max rel err {e:.1e}  "
                  f"{'OK' if good else 'MISMATCH'}  ({t * 1e3:.1f} ms)")
        print("result:", "all ranks match the numpy reference" if all(s[1] for s in summary) else "MISMATCH")
    a2a.destroy()
    comm.finalize()
    raise SystemExit(0 if all(s[1] for s in summary) else 1)


if __name__ == "__main__":
    main()
