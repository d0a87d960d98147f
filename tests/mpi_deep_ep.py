"""moecomm.compat.deep_ep as a DeepEP low-latency program calls it, on any transport: every rank's token t
carries its rank in all but its last 128 values and t in those; each dispatch (bf16, FP8 with float32, power-of-
two and packed UE8M0 scales; whole, and with the receive hook) is checked as DeepEP's own test checks it (counts
against the gathered top-k ids, the cumulative statistics, each slot's source token from the handle and from
the values, per-source counts in the layout range, values within the FP8 rounding), the FP8 values and scales
also bit-exactly against moecomm.reference, then combine (copied, then zero-copy: the same handle combined
again, as DeepEP's test does) against the weighted sum; a dispatch left uncombined; two calls' results held at
once (the first's unchanged by the second); LogFMT, a normal-mode dispatch with no routing and statistics of
another dtype are refused with moecomm errors and the next call works; on GPUs, the pair captured into a CUDA
graph and replayed (the statistics added to at every replay). The calls run
under torch's default dtype bfloat16 and default device, as DeepEP's init_dist leaves its tests.

    mpiexec -n 2 python tests/mpi_deep_ep.py [--transport host|ipc|nvshmem]

Prints "<n> checks on <w> ranks: <f> failures" on rank 0.
"""
import argparse

import numpy as np
import torch

import moecomm
from moecomm import reference
from moecomm.compat import deep_ep
from report import finish

T, H, K, E_PER_RANK = 16, 512, 4, 6
OFFSET = 128  # rank r's tokens hold r - OFFSET (exact in bf16)


def per_token_cast_back(x, scales):
    """e4m3 [n, H] and scales [n, H / 128] (float32, or int32 of four UE8M0) as float32 values."""
    if scales.dtype == torch.int32:
        scales = (scales.reshape(-1).view(torch.uint8).to(torch.int32) << 23).view(torch.float32).view(x.size(0), -1)
    return (x.float().view(x.size(0), -1, 128) * scales.float().unsqueeze(-1)).view(x.size(0), -1)


def off(got, want):
    """got's largest difference from want, relative to want's largest value."""
    return ((got.float() - want).abs().max() / want.abs().max()).item()


def check(comm, fails, device):
    W, r = comm.world_size, comm.rank
    E, L = E_PER_RANK * W, E_PER_RANK
    gen = torch.Generator().manual_seed(r)
    x = torch.full((T, H), float(r - OFFSET)).to(torch.bfloat16)
    x[:, -128:] = torch.arange(T).view(-1, 1).to(torch.bfloat16)
    scores = torch.rand((T, E), generator=gen) + 1
    topk_idx = torch.topk(scores, K, dim=-1).indices
    topk_idx[torch.rand((T, K), generator=gen) < 0.1] = -1
    topk_weights = torch.rand((T, K), generator=gen)
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    want = x.float() * topk_weights.masked_fill(topk_idx < 0, 0).sum(1, keepdim=True)  # each combine's weighted sum
    all_idx = torch.from_numpy(np.stack(comm.allgather(topk_idx.cpu().numpy())))  # [W, T, K]
    all_x = comm.allgather(x.cpu().view(torch.int16).numpy())
    torch.set_default_dtype(torch.bfloat16)  # as DeepEP's init_dist leaves a program: its calls run under a
    torch.set_default_device(device)  # default-device mode, which sees every torch call (compat.deep_ep avoids it)
    buffer = deep_ep.Buffer(comm, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, W, E),
                            low_latency_mode=True)
    checks = 0
    for hook_mode in (False, True):
        for use_fp8, round_scale, use_ue8m0 in ((False, False, False), (True, False, False), (True, True, False),
                                                (True, True, True)):
            label = f"fp8={use_fp8} round_scale={round_scale} ue8m0={use_ue8m0} hook={hook_mode}"
            stats = torch.full((L,), 5, dtype=torch.int32, device=device)  # added to, as DeepEP's
            recv, count, handle, event, hook = buffer.low_latency_dispatch(
                x, topk_idx, T, E, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8,
                round_scale=round_scale, use_ue8m0=use_ue8m0, async_finish=not hook_mode, return_recv_hook=hook_mode)
            hook() if hook_mode else event.current_stream_wait()
            if use_fp8:
                values = per_token_cast_back(recv[0].view(-1, H), recv[1].contiguous().view(-1, recv[1].size(-1)))
                values = values.view(L, W * T, H)
            else:
                values = recv.float()
            src_info, layout_range = handle[0].cpu(), handle[1].cpu()
            for i in range(L):
                expert = r * L + i
                n = int(count[i])
                want_n = int((all_idx == expert).sum())
                if n != want_n or int(stats[i]) != 5 + n or int((layout_range[i] & 0xFFFFFFFF).sum()) != n:
                    fails.append(f"{label}: expert {expert}: {n} tokens, stats {int(stats[i])} (from 5), layout range "
                                 f"{layout_range[i].tolist()}; the ids route {want_n} to it")
                    continue
                v = values[i, :n].cpu()
                if not torch.equal(v[:, :-128].amin(-1), v[:, :-128].amax(-1)):
                    fails.append(f"{label}: expert {expert}: a token's rank values differ within its row")
                # the source rank from the values: not with power-of-two scales, which round r - 128 alike for
                # neighbouring ranks (as DeepEP's test, which skips it there); the layout range's counts always
                src_rank = (v[:, 0] + OFFSET).round().long()
                first = 0  # each source's tokens in consecutive slots, sources in rank order (DeepEP's layout)
                for j in range(W):
                    routed = int((all_idx[j] == expert).sum())
                    begin, got = int(layout_range[i, j] >> 32), int(layout_range[i, j] & 0xFFFFFFFF)
                    if (not round_scale and int((src_rank == j).sum()) != routed) or got != routed:
                        fails.append(f"{label}: expert {expert}: source {j}'s token count differs")
                    elif routed and (begin != first or
                                     (not round_scale and not bool((src_rank[begin:begin + got] == j).all()))):
                        fails.append(f"{label}: expert {expert}: source {j}'s range {begin}..{begin + got - 1} "
                                     f"is not its tokens' (from slot {first})")
                    first += routed
                tol = 0.07 if round_scale else 0.04  # e4m3: 2^-4 of the value (power-of-two scales: one more bit)
                if not torch.allclose(v[:, -1], src_info[i, :n].float(), rtol=tol, atol=0):
                    fails.append(f"{label}: expert {expert}: slots' token markers {v[:, -1].tolist()} != "
                                 f"handle's source tokens {src_info[i, :n].tolist()}")
                if use_fp8:  # bit-exact against the reference's rounding of the token the handle names
                    src = [all_x[int(s)][int(t)] for s, t in zip(src_rank, src_info[i, :n])]
                    scale_dtype = np.int32 if use_ue8m0 else np.float32
                    q, sc = reference.quantize_tokens(np.stack(src).view(moecomm.bfloat16).reshape(n, H),
                                                      "e4m3_ue8m0" if round_scale else "e4m3", scale_dtype)
                    got_q = recv[0][i, :n].cpu().view(torch.uint8).numpy()
                    got_s = recv[1][i, :n].cpu().contiguous().numpy()
                    if not (np.array_equal(got_q, q.view(np.uint8)) and np.array_equal(got_s, sc)):
                        fails.append(f"{label}: expert {expert}: FP8 values or scales differ from the reference")
            checks += 1
            # combine: the experts are the identity on the dequantised values (DeepEP's simulated GEMM)
            y = values.to(torch.bfloat16).to(device)
            for zero_copy in (False, True):
                if zero_copy:
                    buffer.get_next_low_latency_combine_buffer(handle)[:] = y
                out = torch.empty((T, H), dtype=torch.bfloat16, device=device)
                combined, event, hook = buffer.low_latency_combine(y, topk_idx, topk_weights, handle,
                                                                   zero_copy=zero_copy, return_recv_hook=hook_mode,
                                                                   async_finish=not hook_mode, out=out)
                hook() if hook_mode else event.current_stream_wait()
                err, bound = off(combined, want), 0.07 if use_fp8 else 0.01
                if combined.data_ptr() != out.data_ptr() or not err <= bound:
                    fails.append(f"{label} zero_copy={zero_copy}: combine off by {err:.3g} of the largest value "
                                 f"(bound {bound})")
                checks += 1
    # a dispatch left uncombined, then another (DeepEP's test does so); the same handle combined again
    buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)
    recv, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)
    combined, _, _ = buffer.low_latency_combine(recv, topk_idx, topk_weights, handle)
    if not off(combined, want) <= 0.01:
        fails.append("the dispatch after an uncombined one is combined wrong")
    combined, _, _ = buffer.low_latency_combine(recv * 2, topk_idx, topk_weights, handle)  # the same handle again
    if not off(combined, 2 * want) <= 0.01:
        fails.append("a handle combined twice: the second combine is wrong")
    checks += 2
    # two calls' results held at once (DeepEP's rule): the first's stay as they were through the second
    first_recv, _, first, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)
    first_out, _, _ = buffer.low_latency_combine(first_recv, topk_idx, topk_weights, first)
    held = lambda: [t.view(torch.uint8) for t in (first_recv, first_out, first[0], first[1])]  # noqa: E731 (bits)
    kept = [t.clone() for t in held()]
    second_recv, _, second, _, _ = buffer.low_latency_dispatch(x * 2, topk_idx, T, E, use_fp8=False)
    second_out, _, _ = buffer.low_latency_combine(second_recv, topk_idx, topk_weights, second)
    if not all(torch.equal(a, b) for a, b in zip(kept, held())):
        fails.append("two calls' results held: the first's changed during the second")
    if not off(second_out, 2 * want) <= 0.01:
        fails.append("two calls' results held: the second combine is wrong")
    checks += 1
    # refusals: LogFMT (the call ends on every rank), a normal-mode dispatch with no routing; then a call works
    _, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)
    for name, call in (("LogFMT", lambda: buffer.low_latency_combine(y, topk_idx, topk_weights, handle,
                                                                      use_logfmt=True)),
                       ("a normal-mode dispatch with no routing", lambda: buffer.dispatch(x)),
                       ("int64 statistics", lambda: buffer.low_latency_dispatch(
                           x, topk_idx, T, E, torch.zeros(L, dtype=torch.int64, device=device), use_fp8=False))):
        try:
            call()
            fails.append(f"{name}: accepted")
        except moecomm.InvalidArgument:
            pass
        checks += 1
    recv, count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)
    combined, _, _ = buffer.low_latency_combine(recv, topk_idx, topk_weights, handle)
    if not off(combined, want) <= 0.01:
        fails.append("the call after the refusals is wrong")
    checks += 1
    if device != "cpu":  # the pair captured into a CUDA graph (torch.cuda.graph, as serving engines capture it)
        stats = torch.zeros(L, dtype=torch.int32, device=device)

        def pair():  # the experts the identity on their own dispatch's rows (the slots' order differs per call)
            got, _, h, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E, stats, use_fp8=False)
            return buffer.low_latency_combine(got, topk_idx, topk_weights, h)[0]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            pair()  # the graph's pool sees the pair's allocations once before capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = pair()
        stats.zero_()
        for n in range(3):  # every rank replays its graph as often: the kernels pair the replays
            replayed.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            err = off(replayed, want)
            if not err <= 0.01:
                fails.append(f"the pair replayed from a CUDA graph ({n + 1}): off by {err:.3g}")
                break
        want_stats = 3 * torch.stack([(all_idx == r * L + i).sum() for i in range(L)]).to(stats)
        if not torch.equal(stats, want_stats):
            fails.append(f"the statistics after 3 replays: {stats.tolist()}, expected {want_stats.tolist()}")
        checks += 1
    buffer.destroy()
    return checks


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--transport", default="host")
    transport = p.parse_args().transport
    comm = moecomm.init(transport=transport, timeout=5.0 if transport == "host" else 30.0)
    device = "cpu" if transport == "host" else f"cuda:{comm.device}"
    fails = []
    checks = check(comm, fails, device)
    finish(comm, fails, checks)


if __name__ == "__main__":
    main()
