"""A whole MoE layer in PyTorch on moecomm, captured once in a torch CUDA graph and replayed with new tokens,
new routing and a new token count m at every step; each step is checked against the same layer computed
on one GPU in plain PyTorch.

    mpirun -np 2 python examples/torch_moe.py [--steps 8]

The layer: router logits -> torch.topk (int64 ids, as they are) -> per-128-column FP8 quantisation ->
dispatch (tokens + scales + router weights) -> every local expert as a batched matmul over its slots ->
combine (weighted sums on the expert side). Tensors go to moecomm as they are; stream=None means torch's
current stream, so the calls are captured like any torch op. bound_m holds m on the device; the ids of
the padding rows at or past m are -1, the convention of padded batches (moecomm reads only m rows).
"""
import argparse
import sys

import torch

import moecomm


def quantize(x, block=128):
    """bf16 [m, h] -> (fp8 e4m3 [m, h], float32 scales [m, h / block]) with per-block absmax scales."""
    xb = x.float().view(x.shape[0], -1, block)
    scale = xb.abs().amax(-1).clamp(min=1e-6) / 448.0
    return (xb / scale[..., None]).to(torch.float8_e4m3fn).view(x.shape), scale


def dequantize(q, scale, block=128):
    return (q.float().view(*q.shape[:-1], -1, block) * scale[..., None]).view(q.shape)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=128, help="max tokens per rank")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    p.add_argument("--experts-per-rank", type=int, default=4, help="experts on each rank (default 4)")
    p.add_argument("--topk", type=int, default=4, help="experts per token (default 4)")
    p.add_argument("--steps", type=int, default=8, help="steps (default 8)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("examples/torch_moe.py needs an NVIDIA GPU per rank and PyTorch's CUDA build (it captures the layer "
                 "in a torch CUDA graph); without a GPU, run examples/train_torch.py")

    comm = moecomm.init()
    W, rank, M, H, K = comm.world_size, comm.rank, args.tokens, args.hidden, args.topk
    E, L = args.experts_per_rank * W, args.experts_per_rank
    dev = torch.device("cuda", comm.device)
    torch.cuda.set_device(dev)
    a2a = moecomm.AllToAll(comm, M, E, K, H, H // 128, "float8_e4m3fn", "bfloat16")

    gen = torch.Generator().manual_seed(0)  # every rank draws the same weights
    w_router = (torch.randn(H, E, generator=gen) / H ** 0.5).to(dev)
    w_experts = (torch.randn(E, H, H, generator=gen) / H ** 0.5).to(dev, torch.bfloat16)
    w_local = w_experts[rank * L:(rank + 1) * L]

    # static buffers of the captured layer
    x = torch.zeros(M, H, dtype=torch.bfloat16, device=dev)
    bound_m = torch.zeros(1, dtype=torch.int32, device=dev)
    call_id = torch.zeros(1, dtype=torch.int32, device=dev)  # the step's number: a rank out of step raises OutOfStep
    counts = torch.zeros(L, dtype=torch.int32, device=dev)
    expert_x = torch.zeros(L, M * W, H, dtype=torch.float8_e4m3fn, device=dev)
    expert_scale = torch.zeros(L, M * W, H // 128, dtype=torch.float32, device=dev)
    out = torch.zeros(M, H, dtype=torch.bfloat16, device=dev)

    def route(x, m):
        weights, ids = torch.topk((x.float() @ w_router).softmax(-1), K)  # float32, int64
        rows = torch.arange(x.shape[0], device=x.device)[:, None]
        return weights, ids.masked_fill(rows >= m, -1)

    def layer():
        weights, ids = route(x, bound_m)
        q, scale = quantize(x)
        a2a.dispatch(counts, expert_x, expert_scale, q, scale, ids, bound_m, weights=weights, call_id=call_id)
        y = torch.bmm(dequantize(expert_x, expert_scale).to(torch.bfloat16), w_local)
        a2a.combine(out, ids, None, y, bound_m)
        return ids

    def reference(x, m):
        """The same layer on this GPU alone, all experts local."""
        weights, ids = route(x, m)
        xq = dequantize(*quantize(x)).to(torch.bfloat16)
        y_all = torch.einsum("mh,ehd->emd", xq.float(), w_experts.float()).to(torch.bfloat16)  # every expert
        y = y_all[ids.clamp(min=0), torch.arange(x.shape[0], device=x.device)[:, None]]  # [m, k, h]
        return (weights[..., None] * y.float()).sum(1)[:m]

    side = torch.cuda.Stream(dev)  # warm up off the default stream, as torch asks before capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        bound_m.fill_(M)
        layer()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids_static = layer()

    ok, worst = True, 0.0
    for step in range(args.steps):
        gen_step = torch.Generator().manual_seed(1000 * step + rank)
        m = int(torch.randint(1, M + 1, (1,), generator=gen_step))
        x.copy_(torch.randn(M, H, generator=gen_step).to(dev, torch.bfloat16))
        bound_m.fill_(m)
        call_id.fill_(step + 1)  # 0 was the warm-up's and the capture's
        out.fill_(float("nan"))
        graph.replay()
        a2a.synchronize()  # raises what the kernels recorded (a peer's timeout, bad ids)
        want = reference(x, m)
        err = ((out[:m].float() - want).norm() / want.norm()).item()
        worst = max(worst, err)
        ok = ok and err < 2e-2 and bool((ids_static[m:] == -1).all())
    results = comm.allgather((ok, worst))
    if rank == 0:
        print(f"torch MoE layer: {W} ranks, {M} tokens/rank max, hidden {H}, {E} experts, top-{K}, FP8 "
              f"dispatch; one CUDA graph replayed {args.steps} times with new tokens, routing and m")
        for r, (good, e) in enumerate(results):
            print(f"  rank {r}: worst relative error vs one-GPU torch {e:.2e}  {'OK' if good else 'MISMATCH'}")
        print("result:", "all ranks match" if all(g for g, _ in results) else "MISMATCH")
    a2a.destroy()
    comm.finalize()
    sys.exit(0 if all(g for g, _ in results) else 1)


if __name__ == "__main__":
    main()
