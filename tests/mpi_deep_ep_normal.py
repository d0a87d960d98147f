"""moecomm.compat.deep_ep's normal mode as DeepEP's own tests/test_intranode.py calls it (its checks, ported: torch
tensors on the host transport's ranks): get_dispatch_layout against the counts made from topk_idx; dispatch of
random bf16 tokens, of tokens holding their rank, and of those in FP8 with per-token scales, with and without
top-k, async and with a previous event: the rows received and every source's range (rank_prefix_matrix), the tokens
per local expert, recv_topk_idx and recv_topk_weights, num_worst_tokens (the same rows padded, -1 ids past them),
the cached dispatch, expert_alignment; combine (each token's rows summed over the ranks that got it, its top-k
weights alike). Then the training pattern (Megatron's DeepEP dispatcher): an autograd function whose backward swaps
dispatch and combine (the handle's combine, a cached dispatch), gradients against the dense computation; and the
refusals (internode, a cached dispatch given top-k, num_worst_tokens too small) on every rank, the next call right.
On GPUs the same with CUDA tensors (torch's default device, as DeepEP's tests set it).

    mpiexec -n 3 python tests/mpi_deep_ep_normal.py [--transport host|ipc|nvshmem]

Prints "<n> checks on <w> ranks: <f> failures" on rank 0.
"""
import argparse

import numpy as np
import torch

import moecomm
from moecomm.compat import deep_ep
from report import finish

T, H, K, E_PER_RANK = 24, 256, 4, 4


def per_token_cast_to_fp8(x):
    """DeepEP's utils: x [n, H] as e4m3 and float32 scales [n, H / 128] (one per 128 values, amax / 448)."""
    m, n = x.shape
    view = x.float().view(m, -1, 128)
    amax = view.abs().amax(dim=2).view(m, -1).clamp(1e-4)
    return (view * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(m, n), (amax / 448.0).view(m, -1)


def per_token_cast_back(x, scales):
    return (x.float().view(x.size(0), -1, 128) * scales.float().unsqueeze(-1)).view(x.size(0), -1).to(torch.bfloat16)


def calc_diff(x, y):
    """DeepEP's utils: 1 - cosine-like similarity of x and y (float64)."""
    x, y = x.double() + 1, y.double() + 1
    return (1 - 2 * (x * y).sum() / (x * x + y * y).sum()).item()


def intranode(comm, buffer, fails):
    """DeepEP's test_intranode.test_main's checks at this module's shape."""
    W, rank = comm.world_size, comm.rank
    E = E_PER_RANK * W
    torch.manual_seed(rank)
    x = torch.ones((T, H), dtype=torch.bfloat16) * rank
    x_pure_rand = torch.randn((T, H), dtype=torch.bfloat16)
    x_e4m3 = per_token_cast_to_fp8(x)
    x_e4m3 = (x_e4m3[0], x_e4m3[1].T.contiguous().T)  # column-major scales, as DeepEP's test passes them
    scores = torch.randn((T, E), dtype=torch.float32).abs() + 1
    topk_idx = torch.topk(scores, K, dim=-1, largest=True, sorted=False)[1]
    topk_idx[0] = -1  # a token routed nowhere
    topk_weights = torch.ones((T, K), dtype=torch.float32) * rank
    topk_weights_pure_rand = torch.randn((T, K), dtype=torch.float32)
    rank_idx = torch.where(topk_idx >= 0, topk_idx // E_PER_RANK, -1)
    gather = lambda t: torch.from_numpy(np.sum(comm.allgather(t.cpu().numpy()), axis=0)).to(t.device)  # noqa: E731
    num_tokens_per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=E).int()
    gbl_num_tokens_per_expert = gather(num_tokens_per_expert)
    is_token_in_rank = torch.stack([(rank_idx == i).any(dim=1) for i in range(W)], dim=1)
    num_tokens_per_rank = is_token_in_rank.sum(0).int()
    gbl_num_tokens_per_rank = gather(num_tokens_per_rank)
    checks = 1
    ref_rank, _, ref_expert, ref_in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    if not (torch.equal(ref_rank, num_tokens_per_rank) and torch.equal(ref_expert, num_tokens_per_expert)
            and torch.equal(ref_in_rank, is_token_in_rank) and ref_in_rank.dtype == torch.bool):
        fails.append("get_dispatch_layout differs from the counts of topk_idx")

    def check_data(check_x, rank_prefix_matrix, label):
        if not torch.equal(check_x.amin(dim=1), check_x.amax(dim=1)):
            fails.append(f"{label}: a row's values differ")
        start = 0
        for i in range(W):
            end = rank_prefix_matrix[i][rank].item()
            if (check_x[start:end, :].int() - i).abs().sum().item() != 0:
                fails.append(f"{label}: rows {start}..{end - 1} are not rank {i}'s")
            start = end

    for previous_mode in (False, True):
        for async_mode in (False, True):
            for current_x in (x_pure_rand, x, x_e4m3):
                for with_topk in (False, True):
                    fp8, pure = isinstance(current_x, tuple), current_x is x_pure_rand
                    label = (f"{'FP8' if fp8 else 'BF16'}{' random' if pure else ''} top-k={with_topk} "
                             f"async={async_mode} previous={previous_mode}")
                    args = dict(x=current_x, num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
                                num_tokens_per_expert=num_tokens_per_expert, config=deep_ep.Config(24, 8, 256),
                                async_finish=async_mode)
                    if with_topk:
                        args.update(topk_idx=topk_idx, topk_weights=topk_weights_pure_rand if pure else topk_weights)
                    if previous_mode:
                        args.update(previous_event=buffer.capture())
                    recv_x, recv_topk_idx, recv_topk_weights, per_expert, handle, event = buffer.dispatch(**args)
                    event.current_stream_wait() if async_mode else ()
                    recv_x = per_token_cast_back(*recv_x) if fp8 else recv_x
                    rank_prefix_matrix = handle[0]
                    checks += 1
                    if gbl_num_tokens_per_rank[rank].item() != recv_x.size(0):
                        fails.append(f"{label}: {recv_x.size(0)} rows, expected {gbl_num_tokens_per_rank[rank]}")
                        continue
                    if gbl_num_tokens_per_expert.view(W, -1)[rank].tolist() != per_expert:
                        fails.append(f"{label}: tokens per expert {per_expert}")
                    if not pure:
                        check_data(recv_x, rank_prefix_matrix, label)
                    recv_topk_weights_clone = None
                    if with_topk:
                        idx_ok = recv_topk_idx.eq(-1) | ((recv_topk_idx >= 0) & (recv_topk_idx < E_PER_RANK))
                        if not bool(idx_ok.all()) or any(recv_topk_idx.eq(i).sum().item() != c
                                                         for i, c in enumerate(per_expert)):
                            fails.append(f"{label}: recv_topk_idx")
                        recv_topk_weights_clone = recv_topk_weights.clone()
                        if not pure:
                            fill = recv_topk_weights.amax(dim=1, keepdim=True).expand_as(recv_topk_weights)
                            recv_topk_weights[recv_topk_idx.eq(-1)] = fill[recv_topk_idx.eq(-1)]
                            check_data(recv_topk_weights, rank_prefix_matrix, f"{label} weights")
                        worst = T * W  # num_worst_tokens: the rows padded, no host count
                        w_x, w_idx, w_w, empty, _, event = buffer.dispatch(**dict(args, num_worst_tokens=worst))
                        event.current_stream_wait() if async_mode else ()
                        w_x = per_token_cast_back(*w_x) if fp8 else w_x
                        n = recv_x.size(0)
                        if not (empty == [] and w_x.size(0) == w_idx.size(0) == w_w.size(0) == worst
                                and torch.equal(recv_x, w_x[:n]) and torch.equal(recv_topk_idx, w_idx[:n])
                                and torch.equal(recv_topk_weights_clone, w_w[:n]) and bool((w_idx[n:] == -1).all())):
                            fails.append(f"{label}: num_worst_tokens")
                    else:  # the cached dispatch
                        cached = dict(x=current_x, handle=handle, async_finish=async_mode)
                        if previous_mode:
                            cached.update(previous_event=buffer.capture())
                        recv_x, *_, event = buffer.dispatch(**cached)
                        event.current_stream_wait() if async_mode else ()
                        recv_x = per_token_cast_back(*recv_x) if fp8 else recv_x
                        if not pure:
                            check_data(recv_x, rank_prefix_matrix, f"{label} cached")
                    combine_args = dict(x=recv_x, handle=handle, async_finish=async_mode)
                    if with_topk:
                        combine_args.update(topk_weights=recv_topk_weights)
                    if previous_mode:
                        combine_args.update(previous_event=buffer.capture())
                    combined_x, combined_topk_weights, event = buffer.combine(**combine_args)
                    event.current_stream_wait() if async_mode else ()
                    count = is_token_in_rank.sum(dim=1).unsqueeze(1).clamp(min=1)
                    check_x = combined_x.float() / count
                    ref_x = x_pure_rand if pure else x
                    if not calc_diff(check_x[1:], ref_x[1:]) < 5e-6 or bool(combined_x[0].any()):
                        fails.append(f"{label}: combine (diff {calc_diff(check_x[1:], ref_x[1:]):.3g})")
                    if with_topk:
                        check_w = combined_topk_weights if pure else combined_topk_weights / count
                        ref_w = (topk_weights_pure_rand if pure else topk_weights).masked_fill(topk_idx < 0, 0)
                        if not calc_diff(check_w[1:], ref_w[1:]) < 1e-9:
                            fails.append(f"{label}: combined top-k weights")
    _, _, _, per_expert, handle, _ = buffer.dispatch(x, num_tokens_per_rank=num_tokens_per_rank,
                                                     is_token_in_rank=is_token_in_rank, topk_idx=topk_idx,
                                                     num_tokens_per_expert=num_tokens_per_expert, expert_alignment=4)
    want = [-(-c // 4) * 4 for c in gbl_num_tokens_per_expert.view(W, -1)[rank].tolist()]
    if per_expert != want:
        fails.append(f"expert_alignment=4: tokens per expert {per_expert}, expected {want}")
    buffer.combine(torch.zeros((handle.rows, H), dtype=torch.bfloat16), handle)
    return checks + 1


class MoE(torch.autograd.Function):
    """The training pattern of Megatron's DeepEP dispatcher, in one function: dispatch, each received row scaled
    by the sum of its local top-k weights (the experts), combine; backward: the combine's backward is a cached
    dispatch of the output's gradient, the dispatch's backward a combine with the handle."""

    @staticmethod
    def forward(ctx, x, buffer, topk_idx, topk_weights, layout):
        num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = layout
        recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=num_tokens_per_rank,
                                                           is_token_in_rank=is_token_in_rank,
                                                           num_tokens_per_expert=num_tokens_per_expert,
                                                           topk_idx=topk_idx, topk_weights=topk_weights)
        scale = recv_w.sum(dim=1, keepdim=True)
        out, _, _ = buffer.combine((recv_x.float() * scale).to(torch.bfloat16), handle)
        ctx.buffer, ctx.handle, ctx.scale = buffer, handle, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_rows, *_ = ctx.buffer.dispatch(grad_out.contiguous(), handle=ctx.handle)  # combine's backward
        grad_x, _, _ = ctx.buffer.combine((grad_rows.float() * ctx.scale).to(torch.bfloat16), ctx.handle)
        return grad_x, None, None, None, None


def training(comm, buffer, fails):
    W, rank = comm.world_size, comm.rank
    E = E_PER_RANK * W
    gen, dev = torch.Generator().manual_seed(100 + rank), torch.empty(0).device  # drawn on the CPU, then moved
    x = torch.randn((T, H), generator=gen, device="cpu").to(dev, torch.bfloat16).requires_grad_()
    topk_idx = torch.topk(torch.rand((T, E), generator=gen, device="cpu"), K, dim=-1).indices.to(dev)
    topk_weights = torch.rand((T, K), generator=gen, device="cpu").to(dev)
    out = MoE.apply(x, buffer, topk_idx, topk_weights, buffer.get_dispatch_layout(topk_idx, E))
    grad = torch.randn((T, H), generator=gen, device="cpu").to(dev, torch.bfloat16)
    out.backward(grad)
    # dense: token t's output is x[t] times the sum of its weights over its ranks (each rank's local share)
    total = topk_weights.sum(dim=1, keepdim=True)
    want_out, want_grad = x.detach().float() * total, grad.float() * total
    for what, got, want in (("forward", out, want_out), ("x's gradient", x.grad, want_grad)):
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        if not err < 0.02:
            fails.append(f"training pattern: {what} off by {err:.3g}")
    return 2


def refusals(comm, buffer, fails):
    """Refused alike on every rank, the next call right."""
    W, E = comm.world_size, E_PER_RANK * comm.world_size
    x = torch.ones((T, H), dtype=torch.bfloat16)
    topk_idx = torch.arange(K).repeat(T, 1)
    layout = buffer.get_dispatch_layout(topk_idx, E)
    args = dict(x=x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
                topk_idx=topk_idx, topk_weights=torch.ones((T, K)))
    _, _, _, _, handle, _ = buffer.dispatch(**args)
    internode = deep_ep.Buffer(comm, int(1e9), int(1e9))
    for label, call in (("a cached dispatch given top-k", lambda: buffer.dispatch(x, handle=handle, topk_idx=topk_idx)),
                        ("num_worst_tokens too small", lambda: buffer.dispatch(**dict(args, num_worst_tokens=1))),
                        ("internode normal mode", lambda: internode.get_dispatch_layout(topk_idx, E)),
                        ("a combine's x of another hidden size",
                         lambda: buffer.combine(torch.zeros((handle.rows, H + 8), dtype=torch.bfloat16), handle))):
        try:
            call()
            fails.append(f"{label}: accepted")
        except moecomm.InvalidArgument:
            pass
    recv_x, _, _, _, handle, _ = buffer.dispatch(**args)
    combined, _, _ = buffer.combine(recv_x, handle)
    if not torch.equal(combined, x * min(W, -(-K // E_PER_RANK))):  # token's ids 0..K-1: ceil(K / E_PER_RANK) ranks
        fails.append("the call after the refusals is wrong")
    return 5


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--transport", default="host")
    transport = p.parse_args().transport
    comm = moecomm.init(transport=transport, timeout=10.0 if transport == "host" else 30.0)
    fails = []
    if transport != "host":  # CUDA tensors by default, as DeepEP's init_dist leaves its tests
        torch.set_default_device(f"cuda:{comm.device}")
    buffer = deep_ep.Buffer(comm, int(2e9), 0)
    checks = intranode(comm, buffer, fails)
    checks += training(comm, buffer, fails)
    checks += refusals(comm, buffer, fails)
    buffer.destroy()
    finish(comm, fails, checks)


if __name__ == "__main__":
    main()
