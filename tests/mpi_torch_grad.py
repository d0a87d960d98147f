"""Gradients through moecomm.torch against the same layers in plain PyTorch with every expert in one process:

    mpiexec -n 2 python tests/mpi_torch_grad.py [--transport host|ipc|nvshmem]   # host: CPU tensors

As tests/mpi_jax_grad.py: every rank's loss is its own tokens' (rows < m, m drawn per rank); backward on each
rank gives, through moecomm's backward, the gradient of the sum of every rank's loss for its tokens, its local
experts' weights and the router (its own tokens' routing). The reference builds the same sum from every
rank's inputs (each rank draws them all). Cases: one layer with router weights at combine and sent with
dispatch (then given to combine too), int64 ids (torch.topk's) and int32, a 2-layer stack in a Python loop
with the router in the loop, and both layers on one AllToAll. Relative L2 error below 2e-2 (bf16). Prints
"<n> checks on <w> ranks: <f> failures".
"""
import argparse

import numpy as np
import torch

import moecomm
import moecomm.torch as mt
from report import finish

M, H, EL, K, LAYERS, TOL = 16, 32, 3, 2, 2, 2e-2


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--transport", default="host")
    comm = moecomm.init(transport=p.parse_args().transport)
    dev = torch.device("cpu") if comm.device < 0 else torch.device("cuda", comm.device)
    W, r = comm.world_size, comm.rank
    E = EL * W
    layer = mt.AllToAll(moecomm.AllToAll(comm, M, E, K, H, None, "bfloat16", "bfloat16", gradients=True))
    gen = torch.Generator().manual_seed(3)  # every rank draws the same parameters
    w_router = (torch.randn(LAYERS, H, E, generator=gen) / H ** 0.5).to(dev)
    w_experts = (torch.randn(LAYERS, E, H, H, generator=gen) / H ** 0.5).to(torch.bfloat16).to(dev)
    mine = slice(r * EL, (r + 1) * EL)

    def route(x, w, ids_dtype):
        wts, ids = torch.topk(torch.softmax(x.float() @ w, -1), K)
        return ids.to(ids_dtype), wts

    def moe(x, m, wr, we_local, at_combine, ids_dtype):
        ids, wts = route(x, wr, ids_dtype)
        _, ex, _ = layer.dispatch(x, None, ids, m, None if at_combine else wts)
        y = torch.einsum("lch,lhd->lcd", ex.float(), we_local.float()).to(torch.bfloat16)
        return layer.combine(ids, wts, y, m)

    def ref(x, wr, we_all):
        ids, wts = route(x, wr, torch.int64)
        y = torch.einsum("mh,ehd->emd", x.float(), we_all.float()).to(torch.bfloat16)
        y = y[ids, torch.arange(x.shape[0], device=x.device)[:, None]]
        return (wts[..., None] * y.float()).sum(1).to(torch.bfloat16)

    def loss(out, m, target):
        o = out.float() * (torch.arange(M, device=out.device) < m[0])[:, None]
        return (o * target).sum() + 0.1 * (o * o).sum()

    fails, checks = [], 0

    def close(name, got, want):
        nonlocal checks
        checks += 1
        got, want = got.float().cpu().numpy(), want.float().cpu().numpy()
        err = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
        if not err < TOL:  # NaN fails
            fails.append(f"rank {r}: {name}: relative error {err:.3g}")

    cases = [("one layer, weights at combine", 1, True, torch.int32),
             ("one layer, weights sent with dispatch, int64 ids", 1, False, torch.int64),
             ("two layers in a loop, router in the loop", LAYERS, False, torch.int32)]
    for step in range(2):
        inputs = []
        for q in range(W):
            rng = np.random.default_rng([q, step])
            m = M if step == 1 and q == 0 else int(rng.integers(1, M))
            inputs.append((torch.from_numpy(rng.standard_normal((M, H)).astype(np.float32)).to(torch.bfloat16).to(dev),
                           torch.tensor([m], dtype=torch.int32, device=dev),
                           torch.from_numpy(rng.standard_normal((M, H)).astype(np.float32)).to(dev)))
        for name, layers, at_combine, ids_dtype in cases:
            x, m, target = inputs[r]
            x = x.clone().requires_grad_()
            wr = w_router.clone().requires_grad_()
            we = w_experts[:, mine].clone().requires_grad_()
            out = x
            for n in range(layers):
                out = moe(out, m, wr[n], we[n], at_combine, ids_dtype)
            loss(out, m, target).backward()
            xs = [i[0].clone().requires_grad_() for i in inputs]
            wr_ref, we_ref = w_router.clone().requires_grad_(), w_experts.clone().requires_grad_()
            total = 0
            for q in range(W):
                o = xs[q]
                for n in range(layers):
                    o = ref(o, wr_ref[n], we_ref[n])
                total = total + loss(o, inputs[q][1], inputs[q][2])
            total.backward()
            own = w_router.clone().requires_grad_()  # the router's gradient from this rank's tokens alone
            o = inputs[r][0]
            for n in range(layers):
                o = ref(o, own[n], w_experts[n])
            loss(o, m, target).backward()
            close(f"{name}: d/d tokens", x.grad, xs[r].grad)
            close(f"{name}: d/d router", wr.grad, own.grad)
            close(f"{name}: d/d local experts", we.grad, we_ref.grad[:, mine])
    layer.a2a.destroy()
    finish(comm, fails, checks)


if __name__ == "__main__":
    main()
