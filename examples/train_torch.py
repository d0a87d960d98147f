"""Training a 2-layer MoE stack in PyTorch through moecomm: a few SGD steps on every rank's own tokens, the loss
falling, and the first step's gradients checked against the same stack computed in one process in plain
PyTorch.

    mpiexec -n 2 python examples/train_torch.py [--steps 8] [--transport ipc]   # default: host, CPU tensors

Each layer: router (softmax, torch.topk: int64 ids) -> dispatch (router weights sent with it) -> every local
expert as one batched matmul over its slots -> combine (summed on the expert side; the weights are given to
combine too, which is how their gradient flows). The task: fit a fixed random teacher. Expert weights live on
their rank and take their full gradient there; the router is replicated, so its gradient is summed over the
ranks. On a GPU transport the tensors are CUDA tensors.
"""
import argparse

import numpy as np
import torch

import moecomm
import moecomm.torch as mt


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    p.add_argument("--experts-per-rank", type=int, default=2, help="experts on each rank (default 2)")
    p.add_argument("--topk", type=int, default=2, help="experts per token (default 2)")
    p.add_argument("--steps", type=int, default=8, help="steps (default 8)")
    p.add_argument("--lr", type=float, default=0.5, help="SGD learning rate (default 0.5)")
    p.add_argument("--transport", default="host", choices=["host", "ipc", "nvshmem"],
                   help="host (CPU tensors), or a GPU transport (CUDA tensors)")
    args = p.parse_args()

    comm = moecomm.init(transport=args.transport)
    dev = torch.device("cpu") if comm.device < 0 else torch.device("cuda", comm.device)
    W, r, M, H, K, LAYERS = comm.world_size, comm.rank, args.tokens, args.hidden, args.topk, 2
    L = args.experts_per_rank
    E = L * W
    layer = mt.AllToAll(moecomm.AllToAll(comm, M, E, K, H, None, "bfloat16", "bfloat16", gradients=True))
    gen = torch.Generator().manual_seed(0)  # the same on every rank
    router = (torch.randn(LAYERS, H, E, generator=gen) / H ** 0.5).to(dev).requires_grad_()
    experts_all = (torch.randn(LAYERS, E, H, H, generator=gen) / H ** 0.5).to(dev)
    teacher = (torch.randn(H, H, generator=gen) / H ** 0.5).to(dev)
    experts = experts_all[:, r * L:(r + 1) * L].clone().requires_grad_()  # this rank's, float32 master weights

    def data(q):  # rank q's tokens and targets
        x = torch.randn(M, H, generator=torch.Generator().manual_seed(100 + q)).to(dev)
        return x.to(torch.bfloat16), torch.tanh(x @ teacher)
    x, target = data(r)
    m = torch.tensor([M], dtype=torch.int32, device=dev)

    def route(h, w):
        wts, ids = torch.topk(torch.softmax(h.float() @ w, -1), K)
        return ids, wts

    def moe(h, w_router, w_local, call_id):  # call_id [1] int32: step * LAYERS + layer, alike on every rank
        ids, wts = route(h, w_router)
        _, ex, _ = layer.dispatch(h, None, ids, m, wts, call_id=call_id)
        y = torch.einsum("lch,lhd->lcd", ex.float(), w_local.to(torch.bfloat16).float()).to(torch.bfloat16)
        return h + layer.combine(ids, wts, y, m)  # a residual stream

    def moe_ref(h, w_router, w_all, _call_id):  # every expert here
        ids, wts = route(h, w_router)
        y = torch.einsum("mh,ehd->emd", h.float(), w_all.to(torch.bfloat16).float()).to(torch.bfloat16)
        y = y[ids, torch.arange(h.shape[0], device=h.device)[:, None]]
        return h + (wts[..., None] * y.float()).sum(1).to(torch.bfloat16)

    def loss_of(stack, x, target, w_router, w_experts, s):
        h = x
        for n in range(LAYERS):  # numbered calls: a rank out of step raises OutOfStep
            h = stack(h, w_router[n], w_experts[n], torch.tensor([s * LAYERS + n], dtype=torch.int32, device=dev))
        return ((h.float() - target) ** 2).mean()

    losses, worst = [], 0.0
    for s in range(args.steps):
        loss = loss_of(moe, x, target, router, experts, s)
        loss.backward()
        g_router = sum(comm.allgather(router.grad.cpu().numpy()))  # replicated: summed over the ranks
        losses.append(sum(comm.allgather(loss.item())) / W)
        if s == 0:  # the gradients of the sum over ranks of the loss, in one process, from every rank's data
            w_r, w_e = router.detach().clone().requires_grad_(), experts_all.clone().requires_grad_()
            sum(loss_of(moe_ref, *data(q), w_r, w_e, 0) for q in range(W)).backward()
            for got, want in ((g_router, w_r.grad.cpu().numpy()),
                              (experts.grad.cpu().numpy(), w_e.grad[:, r * L:(r + 1) * L].cpu().numpy())):
                worst = max(worst, float(np.linalg.norm(got - want) / np.linalg.norm(want)))
        with torch.no_grad():
            router -= args.lr * torch.from_numpy(g_router).to(dev)
            experts -= args.lr * experts.grad
        router.grad, experts.grad = None, None
    worst = max(comm.allgather(worst))
    ok = losses[-1] < 0.8 * losses[0] and worst < 2e-2
    if r == 0:
        print(f"moecomm PyTorch training: {W} ranks, {M} tokens/rank, hidden {H}, {E} experts, top-{K}, {LAYERS} "
              f"layers")
        print("  loss per step: " + " ".join(f"{v:.4f}" for v in losses))
        print(f"  first step's gradients against one process: max relative error {worst:.2e}")
        print("  result: " + ("the loss falls and the gradients match" if ok else "FAILED"))
    layer.a2a.destroy()
    comm.finalize()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
