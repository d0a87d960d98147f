"""moecomm.compat.deep_ep at DeepEP's test shapes. Low-latency mode (DeepEP's test_low_latency.py shape): one
``low_latency_dispatch`` + ``low_latency_combine`` pair as a program that does not capture calls them (eager), and
the same pair replayed from a CUDA graph; checked against the dense result first (the experts the identity on the
dequantised tokens). Normal mode (``--normal-tokens`` tokens, hidden 7168, top-8 of 256 experts, as
test_intranode.py): the cached ``dispatch`` of bfloat16 and of FP8 tokens and the ``combine``, each phase's device
time beside ``pattern_us``, the same rows copied once by a plain kernel (torch's index_select) in the same run;
checked bit for bit (dispatch) and against the tokens (combine) first.

    mpirun -np 1 python tools/deep_ep_bench.py [--json deep-ep-ws1.json] [--profile] [--parts] [--normal-tokens N]

Times: CUDA events around each pair after a warm-up, median and p99 over ``--iters`` (an eager pair's events
wait for the host where the host is the slower, as DeepEP's own test times it); ``host_pair_us``: the host's own
time per eager pair. ``--profile`` also prints the functions of the eager pairs by their own time per pair
(cProfile inflates every Python frame: read the shares); ``--parts`` times each step of the eager pair alone,
unprofiled, behind a device delay (so no launch waits for the device). Normal mode's ``us`` and ``pattern_us``:
CUDA events around each call with the host ahead of the device (a device delay first, so the host's time is not
in them), median and p99; ``eager_us``: events around each call as DeepEP's own bench times it (host included).
GPUs only (torch tensors on CUDA).
"""
import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time

import numpy as np
import torch

import moecomm
from moecomm import reference
from moecomm.bench import environment
from moecomm.compat import deep_ep


def pair_fn(buffer, x, topk_idx, topk_weights, y, stats, experts):
    """DeepEP's test_func without the receive hooks: FP8 dispatch with the cumulative statistics, combine of y (the
    expert outputs of an earlier dispatch, as DeepEP's test times it: the slots' order may differ between calls, so
    its result is not checked)."""
    def pair():
        _, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, x.size(0), experts,
                                                         cumulative_local_expert_recv_stats=stats, use_fp8=True)
        combined, _, _ = buffer.low_latency_combine(y, topk_idx, topk_weights, handle)
        return combined
    return pair


def identity_experts(q, s):
    """The experts' outputs [L, S, H] bfloat16 when each is the identity on its dequantised tokens: q [L, S, H]
    e4m3, s [L, S, H / 128] float32 (the scales as low_latency_dispatch returns them)."""
    L, S, H = q.shape
    return (q.float().view(L, S, H // 128, 128) * s.unsqueeze(-1)).view(L, S, H).to(torch.bfloat16)


def checked_fn(buffer, x, topk_idx, topk_weights, experts):
    """A pair whose experts are the identity on the dequantised tokens of its own dispatch: its combined tokens are
    x times the sum of each token's weights (up to e4m3's rounding), eager or replayed from a CUDA graph."""
    def pair():
        recv, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, x.size(0), experts, use_fp8=True)
        return buffer.low_latency_combine(identity_experts(*recv), topk_idx, topk_weights, handle)[0]
    return pair


def timed(fn, iters, warmup):
    """Median and p99 in µs of ``fn`` between CUDA events on the current stream, and the host's median."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    host = []
    for start, end in events:
        t = time.perf_counter()
        start.record()
        fn()
        end.record()
        host.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    us = sorted(s.elapsed_time(e) * 1e3 for s, e in events)
    return statistics.median(us), us[min(len(us) - 1, int(0.99 * len(us)))], statistics.median(host) * 1e6


def relative_error(combined, want):
    return ((combined.float() - want).abs().max() / want.abs().max()).item()


def captured_graph(fn):
    """(fn's result, a CUDA graph of fn): run once on a side stream (the graph's pool sees its allocations), then
    captured."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = fn()
    return out, graph


def busy_timed(step, loops, busy, reps=15):
    """Median over ``reps`` of the mean µs of ``loops`` calls of ``step()``, each repetition behind ``busy()`` (a
    device delay on the current stream, so that no launch waits for the device), the device drained after."""
    means = []
    for _ in range(reps):
        busy()
        t0 = time.perf_counter_ns()
        for _ in range(loops):
            step()
        means.append((time.perf_counter_ns() - t0) / loops / 1e3)
        torch.cuda.synchronize()
    return statistics.median(means)


def parts(comm, buffer, pair, bare_pair, stats, topk_idx, topk_weights, y):
    """The eager pair's host time, step by step (rank 0 prints): whole, without the statistics, one prepared
    launch, the core's argument reading (the dispatch's handle arrays apart), then the pair with all launches,
    and then the core's calls, left out (these two leave the device behind the host: run last)."""
    from moecomm._arrays import torch_function_off
    from moecomm.alltoall import CombineArgs, DispatchArgs, SourceLayout
    from moecomm.bench import delay_kernel
    delay_args, delay = delay_kernel(comm.transport)
    stream = torch.cuda.current_stream().cuda_stream

    def busy():  # 20 ms of device work ahead of a repetition's launches
        delay_args.ns = int(20e6)
        delay(stream)

    rows = {"pair (DeepEP's test_func, no hook)": busy_timed(pair, 50, busy),
            "pair without cumulative_local_expert_recv_stats": busy_timed(bare_pair, 50, busy)}
    handle = buffer._last
    layer, x, bound_m = handle.layer, handle.x, handle.bound_m
    a2a, kept = layer.a2a, handle.outputs.kept
    a2a.source_layout(kept.src_info, kept.layout_range, stream)  # its record set: relaunched, it writes the same
    launch = a2a._backend._source_layout
    rows["one prepared launch (the source-layout kernel's)"] = busy_timed(lambda: launch(stream), 200, busy)
    d = DispatchArgs(kept.count, kept.recv_x, kept.scales, x, None, topk_idx, bound_m, stream=stream,
                     sources=SourceLayout(kept.src_info, kept.layout_range, stats))
    c = CombineArgs(kept.combined, topk_idx, topk_weights, y, bound_m, stream=stream)
    with torch_function_off():
        rows["_read_dispatch (core: the dispatch's 6 arrays)"] = busy_timed(lambda: a2a._read_dispatch(d), 2000, busy)
        rows["_read_sources (core: the handle's 3 arrays)"] = busy_timed(lambda: a2a._read_sources(d, True), 2000,
                                                                          busy)
        rows["_read_combine (core: the combine's 5 arrays)"] = busy_timed(lambda: a2a._read_combine(c), 2000, busy)
    a2a._backend._launch = a2a._backend._source_layout = lambda *_: None
    rows["pair, no launches (the device left behind from here)"] = busy_timed(pair, 200, busy)
    a2a.run = lambda *_, **__: None
    rows["pair, no core calls (compat.deep_ep alone)"] = busy_timed(pair, 200, busy)
    if comm.rank == 0:
        for name, us in rows.items():
            print(f"  {us:7.2f} us  {name}")


def normal_rows(comm, tokens, iters):
    """The normal-mode rows (DeepEP's test_intranode.py shape: hidden 7168, top-8 of 256 experts, ``tokens`` per
    rank): checked first, then each phase timed against its pattern."""
    from moecomm.bench import delay_kernel
    T, H, E, K, W, rank = tokens, 7168, 256, 8, comm.world_size, comm.rank
    buffer = deep_ep.Buffer(comm)
    gen = torch.Generator(device="cuda").manual_seed(100 + rank)
    x = torch.randn((T, H), generator=gen, device="cuda").to(torch.bfloat16)
    topk_idx = torch.topk(torch.rand((T, E), generator=gen, device="cuda"), K, dim=-1).indices
    topk_weights = torch.rand((T, K), generator=gen, device="cuda")
    q, s = reference.quantize_tokens(x.view(torch.int16).cpu().numpy().view(moecomm.bfloat16), "e4m3", np.float32)
    x_e4m3 = (torch.from_numpy(q.view(np.uint8)).cuda().view(torch.float8_e4m3fn),  # scales column-major, as
              torch.from_numpy(s).cuda().T.contiguous().T)  # DeepEP's test passes them (its per_token_cast_to_fp8)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=topk_idx, topk_weights=topk_weights)

    # correct first: the rows every source sends this rank, in rank then token order; each token summed back
    every = comm.allgather((x.view(torch.int16).cpu().numpy(), x_e4m3[0].view(torch.uint8).cpu().numpy(),
                            x_e4m3[1].cpu().numpy(), in_rank[:, rank].cpu().numpy()), "deep_ep_bench: the tokens")
    want = [torch.cat([torch.from_numpy(sent[i][sent[3]]) for sent in every]).cuda() for i in range(3)]
    recv, _, recv_w, _, handle, _ = buffer.dispatch(x, **layout)
    recv8, _, _, _, handle8, _ = buffer.dispatch(x_e4m3, **layout)
    combined, combined_w, _ = buffer.combine(recv, handle, topk_weights=recv_w)
    ranks = in_rank.sum(1, keepdim=True).float()
    err = relative_error(combined.float() / ranks.clamp(min=1), x.float())
    if not (torch.equal(recv.view(torch.int16), want[0]) and torch.equal(recv8[0].view(torch.uint8), want[1])
            and torch.equal(recv8[1], want[2]) and err <= 2 ** -7
            and torch.allclose(combined_w, topk_weights, rtol=1e-6, atol=1e-6)):
        raise SystemExit(f"deep_ep_bench.py: the normal-mode dispatch or combine is wrong (combine {err:.3g})")

    delay_args, delay = delay_kernel(comm.transport)
    rows = torch.nonzero(in_rank.t().reshape(-1)).squeeze(1) % T  # the rows sent, once per destination rank
    n = handle.rows
    copy_x, copy_q = torch.empty((rows.numel(), H), dtype=x.dtype, device="cuda"), torch.empty(
        (rows.numel(), H), dtype=torch.uint8, device="cuda")
    src_q, src_s = x_e4m3[0].view(torch.uint8), x_e4m3[1].contiguous()  # the pattern's FP8 sources
    copy_s = torch.empty((rows.numel(), src_s.size(1)), dtype=src_s.dtype, device="cuda")
    back = torch.empty_like(recv)
    order = torch.arange(n, device="cuda")

    def phases(steps, ahead=True, loops=20):
        """{name: (median, p99) µs} of each step's CUDA events: ``loops`` rounds of the steps per repetition, each
        repetition behind a device delay if ``ahead`` (the host ahead, so no launch waits for the device), else
        eager (the host's time in them where it is the slower); the first repetition warms up."""
        times = {name: [] for name, _ in steps}
        for rep in range(1 + max(1, iters // loops)):
            delay_args.ns = int(30e6 if ahead else 0)
            delay(torch.cuda.current_stream().cuda_stream)
            marks = []
            for _ in range(loops):
                for name, step in steps:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    step()
                    end.record()
                    marks.append((name, start, end))
            torch.cuda.synchronize()
            for name, start, end in marks if rep else ():
                times[name].append(start.elapsed_time(end) * 1e3)
        return {name: (statistics.median(us), sorted(us)[min(len(us) - 1, int(0.99 * len(us)))])
                for name, us in times.items()}

    bf16 = phases([("dispatch", lambda: buffer.dispatch(x, handle=handle)),
                   ("combine", lambda: buffer.combine(recv, handle))])
    fp8 = phases([("dispatch", lambda: buffer.dispatch(x_e4m3, handle=handle8)),
                  ("combine", lambda: buffer.combine(recv, handle8))])
    pattern = phases([("bf16", lambda: torch.index_select(x, 0, rows, out=copy_x)),
                      ("fp8", lambda: (torch.index_select(src_q, 0, rows, out=copy_q),
                                       torch.index_select(src_s, 0, rows, out=copy_s))),
                      ("combine", lambda: torch.index_select(recv, 0, order, out=back))])
    eager = phases([("dispatch bfloat16", lambda: buffer.dispatch(x, handle=handle)),
                    ("combine bfloat16", lambda: buffer.combine(recv, handle)),
                    ("dispatch float8_e4m3fn", lambda: buffer.dispatch(x_e4m3, handle=handle8)),
                    ("combine after FP8", lambda: buffer.combine(recv, handle8))], ahead=False)
    buffer.destroy()
    base = {"mode": "normal", "tokens": T, "hidden": H, "experts": E, "topk": K, "world": W, "rows": n}
    out = []
    for phase, dtype, ours, pat in (("dispatch", "bfloat16", bf16["dispatch"], pattern["bf16"]),
                                    ("dispatch", "float8_e4m3fn", fp8["dispatch"], pattern["fp8"]),
                                    ("combine", "bfloat16", bf16["combine"], pattern["combine"])):
        out.append(dict(base, phase=phase, dtype=dtype, us=ours[0], p99_us=ours[1], pattern_us=pat[0],
                        pattern_p99_us=pat[1], eager_us=eager[f"{phase} {dtype}"][0]))
    out[1]["combine_after_us"] = fp8["combine"][0]
    out[2]["max_relative_error"] = err
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank (DeepEP's test: 128)")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size (DeepEP's test: 7168)")
    p.add_argument("--experts", type=int, default=288, help="experts (DeepEP's test: 288)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (DeepEP's test: 8)")
    p.add_argument("--iters", type=int, default=300, help="timed pairs (default 300)")
    p.add_argument("--profile", action="store_true", help="print the eager pair's functions by own time")
    p.add_argument("--parts", action="store_true", help="time each step of the eager pair alone (rank 0 prints)")
    p.add_argument("--normal-tokens", type=int, default=4096,
                   help="tokens per rank of the normal-mode rows (DeepEP's test_intranode.py: 4096; 0: none)")
    p.add_argument("--json", default="deep-ep-ws1.json", help="output JSON (default deep-ep-ws1.json)")
    args = p.parse_args()
    comm = moecomm.init()
    torch.cuda.set_device(max(comm.device, 0))
    T, H, E, K, W = args.tokens, args.hidden, args.experts, args.topk, comm.world_size
    gen = torch.Generator(device="cuda").manual_seed(comm.rank)
    x = torch.randn((T, H), generator=gen, device="cuda").to(torch.bfloat16)
    scores = torch.rand((T, E), generator=gen, device="cuda")
    topk_idx = torch.topk(scores, K, dim=-1).indices
    topk_idx[torch.rand((T, K), generator=gen, device="cuda") < 0.05] = -1  # some pairs routed nowhere
    topk_weights = torch.rand((T, K), generator=gen, device="cuda")
    stats = torch.zeros(E // W, dtype=torch.int32, device="cuda")
    buffer = deep_ep.Buffer(comm, low_latency_mode=True)

    # correct first, eager and replayed: the experts the identity on the dequantised tokens
    want = x.float() * topk_weights.masked_fill(topk_idx < 0, 0).sum(1, keepdim=True)
    check = checked_fn(buffer, x, topk_idx, topk_weights, E)
    err = relative_error(check(), want)
    if not err <= 0.07:  # e4m3: 2^-4 of the value
        raise SystemExit(f"deep_ep_bench.py: the combined tokens differ from the dense result by {err:.3g}")
    captured, graph = captured_graph(check)
    graph.replay()
    torch.cuda.synchronize()
    err_graph = relative_error(captured, want)
    if not err_graph <= 0.07:
        raise SystemExit(f"deep_ep_bench.py: the replayed pair differs from the dense result by {err_graph:.3g}")
    recv, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True)
    y = identity_experts(*recv)
    buffer.low_latency_combine(y, topk_idx, topk_weights, handle)

    pair = pair_fn(buffer, x, topk_idx, topk_weights, y, stats, E)
    row = {"mode": "low_latency", "tokens": T, "hidden": H, "experts": E, "topk": K, "world": W,
           "max_relative_error": err, "max_relative_error_replayed": err_graph}
    row["eager_pair_us"], row["eager_pair_p99_us"], row["host_pair_us"] = timed(pair, args.iters, 50)
    if args.profile and comm.rank == 0:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            pair()
        prof.disable()
        torch.cuda.synchronize()
        st = pstats.Stats(prof)
        top = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:30]
        print("own µs per pair   calls per pair   function")
        for (f, line, name), (_, calls, own, _, _) in top:
            print(f"{own / 200 * 1e6:12.2f} {calls / 200:12.1f}   {f.rsplit('/', 1)[-1]}:{line} {name}")
    _, graph = captured_graph(pair)
    row["graph_pair_us"], row["graph_pair_p99_us"], _ = timed(graph.replay, args.iters, 50)
    if comm.rank == 0:
        print(json.dumps(row))
    if args.parts:
        bare = pair_fn(buffer, x, topk_idx, topk_weights, y, None, E)
        parts(comm, buffer, pair, bare, stats, topk_idx, topk_weights, y)
    buffer.destroy()
    results = [row] + (normal_rows(comm, args.normal_tokens, args.iters) if args.normal_tokens else [])
    if comm.rank == 0:
        for r in results[1:]:
            print(json.dumps(r))
        argv = [a for i, a in enumerate(sys.argv[1:]) if a != "--json" and sys.argv[i] != "--json"]
        with open(args.json, "w") as f:
            json.dump({"command": " ".join([f"mpirun -np {W} python tools/deep_ep_bench.py", *argv]),
                       "environment": environment(), "results": results}, f, indent=1)
    comm.finalize()


if __name__ == "__main__":
    main()
