"""Gradients along a routing plan on any transport: dispatch_backward and combine_backward equal the
numpy reference's for every input dtype (FP8 straight-through), router weights given at combine or sent with
dispatch, m below max_num_tokens, DP groups, a capacity that drops pairs, replicated experts, column-major
scales with the FP8 combine wire, and the packed layout; a plan kept while another call runs still gives its
own call's gradients; a refused backward argument, and plans of different calls on different ranks, raise on
every rank and the next call is right; a plan is refused before any dispatch.

    mpiexec -n 3 python tests/mpi_backward.py [--transport host|ipc|nvshmem]

Prints "<n> checks on <w> ranks: <f> failures" on rank 0.
"""
import argparse

import numpy as np

import moecomm
import moecomm.balance
from moecomm import reference
from mpi_alltoall import Buffers, Host
from report import finish

A = Host  # the arrays of the transport under test (main): numpy, or DeviceBuffers on GPUs

E_PER_RANK, K, H, M = 3, 2, 512, 10  # H: rows of 64 chunks, which the GPU expert side splits over blocks
CASES = (  # (in_dtype, scales, out_dtype, gradient dtype)
    (moecomm.bfloat16, None, moecomm.bfloat16, moecomm.bfloat16),
    (moecomm.float16, None, moecomm.float16, moecomm.float32),
    (moecomm.float8_e4m3fn, 2, moecomm.bfloat16, moecomm.bfloat16),
)


def draw(comm, dp, seed, dt, scales, gdt, m):
    """Per group: tokens, scales, ids (some -1), weights, the combine's gradient; per rank: grad_expert_x."""
    W, E = comm.world_size, E_PER_RANK * comm.world_size
    groups = []
    for g in range(W // dp):
        rng = np.random.default_rng([seed, g])
        x = rng.standard_normal((M, H)).astype(np.float32).astype(dt)
        xs = rng.random((M, scales), np.float32) if scales else None
        ids = np.argsort(rng.random((M, E)), axis=1)[:, :K].astype(np.int32)
        ids[rng.random((M, K)) < 0.15] = -1
        ids[m:] = -1
        groups.append(dict(x=x, xs=xs, ids=ids, w=rng.random((M, K), np.float32),
                           gout=rng.standard_normal((M, H)).astype(np.float32).astype(gdt)))
    return groups


def new_plan(a2a, fill=0):
    """A RoutingPlan of arrays for ``a2a`` (filled with ``fill``: plan() must write every element)."""
    return moecomm.RoutingPlan(*(A.put(np.full(s, fill, np.int32)) for s in a2a.plan_shapes()))


def got_plan(plan):
    """A plan's arrays as numpy."""
    return moecomm.RoutingPlan(*(A.get(a, np.int32) for a in plan))


def to_padded(a, offsets, capacity, fill):
    """A packed [rows, ...] array as the padded layout's [L, capacity, ...] (slot i = row offsets[e] + i)."""
    out = np.full((len(offsets) - 1, capacity) + a.shape[1:], fill, a.dtype)
    for e in range(len(offsets) - 1):
        out[e, :offsets[e + 1] - offsets[e]] = a[offsets[e]:offsets[e + 1]]
    return out


def check(a2a, comm, groups, m, wd, fails, label, between=None):
    """Forward (plan kept), an optional other call ``between``, then both backward calls, against the
    reference computed from every rank's plan and arrays."""
    c, r, W, dp = a2a.cfg, comm.rank, comm.world_size, a2a.cfg.dp_size
    gdt = groups[0]["gout"].dtype
    mine = groups[r // dp]
    n = A.put(np.zeros(c.num_local_experts, np.int32))
    ex = A.put(np.zeros(c.expert_x_shape(), c.in_dtype))
    es = None if mine["xs"] is None else A.put(np.zeros(c.expert_x_scale_shape(), np.float32))
    off = A.put(np.zeros(c.num_local_experts + 1, np.int32)) if c.layout == "packed" else None
    bm, ids = A.put(np.array([m], np.int32)), A.put(mine["ids"])
    a2a.dispatch(n, ex, es, A.put(mine["x"]), None if mine["xs"] is None else A.put(mine["xs"]), ids, bm,
                 weights=A.put(mine["w"]) if wd else None, out_expert_offsets=off)
    plan = new_plan(a2a, 7)
    a2a.plan(plan)
    y = A.get(ex, c.in_dtype).astype(np.float32) * 0.5 + 1.0
    y = y.astype(c.out_dtype)  # an expert: 0.5 x + 1, written where the slots are empty too
    yd = A.put(y)
    out, dropped = A.put(np.zeros((M, H), c.out_dtype)), A.put(np.zeros((M, K), np.uint8))
    a2a.combine(out, ids, None if wd else A.put(mine["w"]), yd, bm, out_dropped=dropped)
    if between is not None:
        between()
    rng = np.random.default_rng([hash(label) % 2 ** 32, r])
    gex = rng.standard_normal(c.expert_x_shape()).astype(np.float32).astype(gdt)
    gx = A.put(np.full((M, H), 9, gdt))
    a2a.dispatch_backward(gx, plan, A.put(gex), bm)
    gey, gw = A.put(np.full(c.expert_x_shape(), 9, gdt)), A.put(np.full((M, K), 9, np.float32))
    a2a.combine_backward(gey, gw, plan, A.put(mine["gout"]), A.put(mine["w"]), yd, bm)
    a2a.synchronize()
    gx, gey, gw, plan = A.get(gx, gdt), A.get(gey, gdt), A.get(gw, np.float32), got_plan(plan)
    n, dropped = A.get(n, np.int32), A.get(dropped, np.uint8)
    off = None if off is None else A.get(off, np.int32)

    phys = mine["ids"] if a2a.expert_map is None else a2a.expert_map.physical(mine["ids"], np.arange(M), r // dp)
    E = c.num_local_experts * W  # physical experts: the reference's
    everyone = comm.allgather((plan.origin, gex, y, gey, off, dropped))
    group_ids = comm.allgather(phys)[::dp]
    if c.layout == "packed":  # compare in the padded layout
        cap = M * (W // dp)
        everyone = [(to_padded(o, f, cap, -1), to_padded(a, f, cap, 0), to_padded(b, f, cap, 0),
                     to_padded(d, f, cap, 0), f, dr) for o, a, b, d, f, dr in everyone]
    origins = [np.where(o[..., :1] >= 0, np.concatenate([o[..., :1] // dp, o[..., 1:2]], axis=-1), -1)
               for o, *_ in everyone]
    want_x = reference.dispatch_backward([e[1] for e in everyone], origins, [M] * (W // dp))[r // dp]
    if not np.allclose(gx[:m].astype(np.float32), want_x[:m].astype(np.float32), rtol=2 ** -7, atol=1e-2):
        fails.append(f"{label}: dispatch_backward differs from the reference")
    if (gx[m:] != 9).any():
        fails.append(f"{label}: dispatch_backward wrote rows >= m")
    want_ey, want_w = reference.combine_backward(group_ids, [g["w"] for g in groups],
                                                 [g["gout"] for g in groups], [e[2] for e in everyone], origins, E, W)
    filled = origins[r][..., 0] >= 0  # the padded layout's slots holding a pair (packed: converted)
    here = plan.origin[..., 0] >= 0  # the same, in this layout's own slots
    if not np.array_equal(everyone[r][3][filled], want_ey[r][filled]):
        fails.append(f"{label}: combine_backward's grad_expert_y differs from the reference")
    if (gey[~here] != 9).any():  # empty slots keep what was there
        fails.append(f"{label}: combine_backward wrote empty slots")
    if not np.allclose(gw[:m], want_w[r // dp][:m], rtol=1e-4, atol=1e-4) or (gw[m:] != 9).any():
        fails.append(f"{label}: combine_backward's grad_weights differ from the reference")
    # the plan: this rank's pairs (its tokens of the DP group), the dropped ones too (they have no slot)
    ids = np.where(np.arange(M)[:, None] % dp == c.dp_rank, phys, -1)
    if not np.array_equal(plan.expert, ids):
        fails.append(f"{label}: plan.expert differs from the pairs this rank sent")
    listed = np.flatnonzero(here)
    if plan.held[0] != listed.size or not np.array_equal(np.sort(plan.held[1:1 + listed.size]), listed):
        fails.append(f"{label}: plan.held does not list the slots plan.origin holds")
    flat = plan.origin.reshape(-1, 3)
    own = np.flatnonzero(flat[:, 0] == r)  # slots of this rank's own pairs
    want_local = np.full((M, K), -1, np.int32)
    want_local[flat[own, 1], flat[own, 2]] = own
    if not np.array_equal(plan.local, want_local):
        fails.append(f"{label}: plan.local does not name the slots of this rank's own pairs")
    if int(filled.sum()) != int(n.sum()):
        fails.append(f"{label}: plan.origin holds {int(filled.sum())} pairs, the dispatch received {int(n.sum())}")


def refused(a2a, comm, groups, fails):
    """One rank passes a grad_expert_x of the wrong shape: it raises InvalidArgument, the others PeerError;
    then a backward call is right."""
    c, r = a2a.cfg, comm.rank
    mine, bm = groups[r // c.dp_size], A.put(np.array([M], np.int32))
    n, ex = A.put(np.zeros(c.num_local_experts, np.int32)), A.put(np.zeros(c.expert_x_shape(), c.in_dtype))
    ids, w = A.put(mine["ids"]), A.put(mine["w"])
    ey = A.put(np.zeros(c.expert_x_shape(), c.out_dtype))
    a2a.dispatch(n, ex, None, A.put(mine["x"]), None, ids, bm)
    plan = new_plan(a2a)
    a2a.plan(plan)
    a2a.combine(A.put(np.zeros((M, H), c.out_dtype)), ids, w, ey, bm)
    gex = np.zeros(c.expert_x_shape(), np.float32)
    bad = A.put(gex[:, :-1] if r == comm.world_size - 1 else gex)
    try:
        a2a.dispatch_backward(A.put(np.zeros((M, H), np.float32)), plan, bad, bm)
        a2a.synchronize()  # GPUs: the peers' kernels recorded the refusal
        fails.append("refused: dispatch_backward with a grad_expert_x of the wrong shape raised nothing")
    except moecomm.PeerError as e:
        if r == comm.world_size - 1 or e.peer != comm.world_size - 1:
            fails.append(f"refused: PeerError {e} on rank {r}")
    except moecomm.InvalidArgument as e:
        if r != comm.world_size - 1 or "grad_expert_x" not in str(e):
            fails.append(f"refused: InvalidArgument {e} on rank {r}")
    gx = A.put(np.zeros((M, H), np.float32))
    a2a.dispatch_backward(gx, plan, A.put(gex + 1), bm)
    a2a.synchronize()
    want = (mine["ids"] >= 0).sum(axis=1)[:, None] * np.ones((1, H), np.float32)
    if not np.array_equal(A.get(gx, np.float32), want):
        fails.append("refused: the next dispatch_backward is wrong")
    # bound_m above the rows of out_grad_x on the last rank: the kernels (GPUs) or the host refuse it
    try:
        short = A.put(np.zeros((M - 2 if r == comm.world_size - 1 else M, H), np.float32))
        a2a.dispatch_backward(short, plan, A.put(gex), bm)
        a2a.synchronize()
        fails.append(f"bound_m over the rows: nothing raised on rank {r}")
    except (moecomm.MoeCommError, moecomm.InvalidArgument) as e:  # every rank raises (the peers name the last)
        if r != comm.world_size - 1 and f"rank {comm.world_size - 1}" not in str(e):
            fails.append(f"bound_m over the rows: {type(e).__name__} {e} on rank {r}")
    a2a.dispatch_backward(gx, plan, A.put(gex + 1), bm)
    a2a.synchronize()
    if not np.array_equal(A.get(gx, np.float32), want):
        fails.append("bound_m over the rows: the next dispatch_backward is wrong")
    if comm.world_size == 1:
        return
    # rank 0 passes the plan of another call (a mixed-up micro-batch): every rank raises, nothing is exchanged
    a2a.dispatch(n, ex, None, A.put(mine["x"]), None, ids, bm)
    later = new_plan(a2a)
    a2a.plan(later)
    a2a.combine(A.put(np.zeros((M, H), c.out_dtype)), ids, w, ey, bm)
    zeros = A.put(np.zeros(c.expert_x_shape(), np.float32))
    for name, call in (("dispatch_backward", lambda p: a2a.dispatch_backward(gx, p, A.put(gex), bm)),
                       ("combine_backward", lambda p: a2a.combine_backward(
                           zeros, A.put(np.zeros((M, K), np.float32)), p,
                           A.put(np.zeros((M, H), np.float32)), w, ey, bm))):
        try:
            call(plan if r == 0 else later)
            a2a.synchronize()
            fails.append(f"mixed plans: {name} raised nothing on rank {r}")
        except moecomm.InvalidArgument as e:
            if "routing plan of dispatch call" not in str(e):
                fails.append(f"mixed plans: {name} on rank {r}: {e}")
    a2a.dispatch_backward(gx, later, A.put(gex + 1), bm)
    a2a.synchronize()
    if not np.array_equal(A.get(gx, np.float32), want):
        fails.append("mixed plans: the next dispatch_backward is wrong")


def main():
    global A
    p = argparse.ArgumentParser()
    p.add_argument("--transport", default="host")
    comm = moecomm.init(transport=p.parse_args().transport, timeout=3.0)
    A = Host if comm.transport.memory == "host" else Buffers
    G = dict(gradients=True)
    W, E = comm.world_size, E_PER_RANK * comm.world_size
    fails, checks = [], 0
    try:
        a2a = moecomm.AllToAll(comm, M, E, K, H, **G)
        a2a.plan(new_plan(a2a))
        fails.append("plan before any dispatch: nothing raised")
    except moecomm.InvalidArgument as e:
        if "no dispatch" not in str(e):
            fails.append(f"plan before any dispatch: {e}")
    checks += 1
    refused(a2a, comm, draw(comm, 1, 5, moecomm.bfloat16, None, np.float32, M), fails)
    checks += 1
    a2a.destroy()
    for dt, scales, odt, gdt in CASES:
        a2a = moecomm.AllToAll(comm, M, E, K, H, scales, dt, odt, **G)
        for wd in (False, True):
            for m in (M, M - 3):
                check(a2a, comm, draw(comm, 1, checks, dt, scales, gdt, m), m, wd, fails,
                      f"{np.dtype(dt).name} weights {'at dispatch' if wd else 'at combine'} m={m}")
                checks += 1
        a2a.destroy()
    a2a = moecomm.AllToAll(comm, M, E, K, H, None, "bf16", "bf16", **G)
    other = draw(comm, 1, 99, moecomm.bfloat16, None, np.float32, M)

    def another_call():  # a dispatch and combine of other tokens between the forward and its backward
        check(a2a, comm, other, M, True, fails, "the call between")
    check(a2a, comm, draw(comm, 1, 50, moecomm.bfloat16, None, np.float32, M - 2), M - 2, False, fails,
          "a plan kept across another call", between=another_call)
    checks += 2
    a2a.destroy()
    if W % 2 == 0:
        a2a = moecomm.AllToAll(comm, M, E, K, H, None, "bf16", "bf16", dp_size=2, **G)
        for wd in (False, True):
            check(a2a, comm, draw(comm, 2, 60 + wd, moecomm.bfloat16, None, np.float32, M - 1), M - 1, wd, fails,
                  f"dp_size 2 weights {'at dispatch' if wd else 'at combine'}")
            checks += 1
        a2a.destroy()
    cap = max(1, M * K // (2 * E_PER_RANK))  # about half the mean demand per expert: some pairs drop
    a2a = moecomm.AllToAll(comm, M, E, K, H, None, "bf16", "bf16", capacity=cap, overflow="drop", **G)
    for wd in (False, True):
        check(a2a, comm, draw(comm, 1, 70 + wd, moecomm.bfloat16, None, np.float32, M), M, wd, fails,
              f"capacity {cap} drop, weights {'at dispatch' if wd else 'at combine'}")
        checks += 1
    a2a.destroy()
    if W > 1:  # replicated experts: every rank's extra slot holds the next rank's first expert
        a2a = moecomm.AllToAll(comm, M, E, K, H, None, "bf16", "bf16", slots_per_rank=E_PER_RANK + 1, **G)
        slots = np.full((W, E_PER_RANK + 1), -1)
        slots[:, :E_PER_RANK] = np.arange(E).reshape(W, E_PER_RANK)
        slots[:, E_PER_RANK] = (np.arange(W) + 1) % W * E_PER_RANK
        a2a.set_expert_map(moecomm.balance.ExpertMap(slots, E, generation=1))
        for wd in (False, True):
            check(a2a, comm, draw(comm, 1, 90 + wd, moecomm.bfloat16, None, np.float32, M), M, wd, fails,
                  f"replicas weights {'at dispatch' if wd else 'at combine'}")
            checks += 1
        a2a.destroy()
    # the formats of the wire beside gradients: column-major scales, the FP8 combine wire (the backward does not
    # depend on either)
    a2a = moecomm.AllToAll(comm, M, E, K, H, 2, moecomm.float8_e4m3fn, "bf16", scale_layout="column",
                           combine_wire="e4m3", **G)
    for wd in (False, True):
        check(a2a, comm, draw(comm, 1, 110 + wd, moecomm.float8_e4m3fn, 2, moecomm.bfloat16, M), M, wd, fails,
              f"column scales, FP8 combine wire, weights {'at dispatch' if wd else 'at combine'}")
        checks += 1
    a2a.destroy()
    a2a = moecomm.AllToAll(comm, M, E, K, H, None, "bf16", "bf16", layout="packed", **G)
    for wd in (False, True):
        check(a2a, comm, draw(comm, 1, 80 + wd, moecomm.bfloat16, None, np.float32, M - 1), M - 1, wd, fails,
              f"packed weights {'at dispatch' if wd else 'at combine'}")
        checks += 1
    a2a.destroy()
    finish(comm, fails, checks)


if __name__ == "__main__":
    main()
