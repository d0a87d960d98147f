"""Render the figure tables of README.md, docs/performance.md and docs/api.md from benchmarks/results/ (the
baselines).

    python tools/figures.py            rewrite every figures block in place
    python tools/figures.py --check    name the blocks that differ from the results, exit 1 if any (a test runs it)

A block is the lines between ``<!-- figures: NAME -->`` and ``<!-- /figures -->``, NAME one of TABLES: a line
naming the results file, its GPUs (from the JSON) and the kernels measured (the first word of the file's "kernels
of" cell in benchmarks/results/INDEX.md), then the table. The prose around a block (what was measured, how)
is written by hand.
"""
import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = (ROOT / "README.md", ROOT / "docs" / "performance.md", ROOT / "docs" / "api.md")
BLOCK = re.compile(r"(<!-- figures: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figures -->)", re.S)
# (label, config, tokens) of the rows of the latency tables
ROWS = (("R1-decode: 128 tokens/rank, 7168 fp8 + 56 scales, 256 experts, top-8", "r1-decode", 128),
        ("R1-prefill: 4096 tokens/rank", "r1-prefill", 4096),
        ("V2-Lite: 128 tokens/rank, 2048 hidden, 64 experts, top-6", "v2-lite", 128),
        ("1 token/rank (R1 shapes)", "sweep", 1),
        ("16 tokens/rank", "sweep", 16),
        ("1024 tokens/rank", "sweep", 1024))
WIRES = {None: "FP8 given (e4m3, float32 scales)", "e4m3": "bf16, quantised by dispatch to e4m3 (float32 scales)",
         "e4m3_ue8m0": "bf16, quantised to e4m3 (power-of-two scales)"}
GRAD_ROWS = {"r1-decode": "decode (128 tokens), worst-case capacity", "r1-decode-cap32": "decode, `capacity=32`",
             "r1-prefill-cap256": "prefill (4096 tokens), `capacity=256`"}


def _load(name):
    return json.loads((RESULTS / name).read_text())


def _us(stat):
    """A time in µs as the tables print it (median or a bare value)."""
    v = stat["median_us"] if isinstance(stat, dict) else stat
    return f"{v:.0f}" if v >= 1000 else f"{v:.1f}" if v >= 20 else f"{v:.2f}"


def _with_p99(stat):
    return f"{_us(stat)} ({_us(stat['p99_us'])})"


def _caption(name):
    """The block's first line: the file, its GPUs and the commit of the kernels it measured."""
    doc = _load(name)
    doc = doc["runs"][0] if "runs" in doc and "environment" not in doc else doc
    gpus = doc["environment"]["gpus"] if "environment" in doc else [doc["gpu"]]
    machine = f"{len(gpus)}× {gpus[0].split(',')[0]}" if len(set(gpus)) == 1 else ", ".join(gpus)
    for line in (RESULTS / "INDEX.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and re.findall(r"`([^`]+)`", cells[0])[0] == name:
            kernels = "no moecomm kernels" if cells[-1].startswith("(no") else f"the kernels of {cells[-1].split()[0]}"
            return f"`benchmarks/results/{name}`: {machine}, {kernels}.\n\n"
    raise SystemExit(f"figures: {name} has no row in benchmarks/results/INDEX.md")


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def _row(results, config, tokens, transport=None):
    return next(r for r in results if r["config"] == config and r["tokens"] == tokens
                and transport in (None, r["transport"]))


def ep2():
    """EP2 on 2×H200, both transports and NCCL (ep2-latency.json)."""
    res = _load("ep2-latency.json")["results"]
    rows = []
    for label, config, tokens in ROWS:
        nv, ipc = _row(res, config, tokens, "nvshmem"), _row(res, config, tokens, "ipc")
        nccl = nv["nccl"]
        rows.append([label, _with_p99(nv["graph"]["total"]), _with_p99(ipc["graph"]["total"]),
                     f"{_us(nv['graph']['split_total'])} / {_us(ipc['graph']['split_total'])}",
                     _us(nv["eager_layer"]), _us(nccl["exact"]), _us(nccl["padded"]) if "padded" in nccl else ""])
    return _caption("ep2-latency.json") + _table(
        ["configuration", "CUDA graph, nvshmem", "CUDA graph, ipc", "split halves, nvshmem / ipc",
         "eager layer, nvshmem", "NCCL exact", "NCCL padded"], rows)


def ws1():
    """World size 1 on one GPU, the local path (ws1-r1-decode.json)."""
    res = _load("ws1-r1-decode.json")["results"]
    rows = []
    for label, config, tokens in ROWS:
        r = _row(res, config, tokens)
        host = r["host_us"]
        rows.append([label, _with_p99(r["graph"]["total"]), _us(r["graph"]["split_total"]),
                     f"{_us(host['buffer']['eager_layer'])} / {_us(host['cupy']['eager_layer'])}",
                     _us(r["nccl"]["exact"])])
    return _caption("ws1-r1-decode.json") + _table(
        ["configuration", "CUDA graph", "split halves (the general kernels)", "eager layer, `DeviceBuffer` / CuPy",
         "NCCL exact"], rows)


def host():
    """Host time per eager call at R1-decode, world size 1, per kind of input (ws1-r1-decode.json)."""
    h = _row(_load("ws1-r1-decode.json")["results"], "r1-decode", 128)["host_us"]
    names = {"buffer": "`DeviceBuffer` (reused)", "cupy": "CuPy arrays", "torch": "torch tensors",
             "cupy prepared": "CuPy arrays, prepared calls", "torch prepared": "torch tensors, prepared calls"}
    return _caption("ws1-r1-decode.json") + _table(["inputs", "dispatch", "combine", "eager layer (host in the loop)"],
                  [[names[k], _us(v["dispatch"]), _us(v["combine"]), _us(v["eager_layer"])] for k, v in h.items()])


LAYERS = {"exchange": "exchange only", "simple": "× 2 in XLA between the halves (worst-case slots)",
          "moe": "whole layer (router, experts at 2× mean capacity, residual)",
          "train": "training step (value_and_grad, jax.checkpoint per layer)"}


def jax():
    """Jitted steps of MoE layers through moecomm.jax against the same kernels in a CUDA graph and the same
    layers with XLA alone (jax-step.json)."""
    rows = []
    for r in _load("jax-step.json")["results"]:
        over = r["per_layer_us"] - r["graph_us"] - r["xla_only_per_layer_us"]
        rows.append([LAYERS[r.get("layer", "exchange")], r["dtype"], f"{r['layers']} layers, {r['form']}",
                     _us(r["per_layer_us"]), _us(r["step_us"]), _us(r["graph_us"]), _us(r["xla_only_per_layer_us"]),
                     f"{over:+.1f}", _us(r["between_us"]) if "between_us" in r else "",
                     f"{r['handler_runs']} / {r['timed_steps']}"])
    return _caption("jax-step.json") + _table(
        ["layer", "dtype", "step", "per layer, pipelined", "one step at a time", "CUDA graph: the layer's kernels",
         "XLA alone, per layer", "per layer − graph − XLA alone", "the op between the halves alone", "handler runs"],
        rows)


def grads():
    """The backward calls against the forward ones, and their memory patterns alone (grad-ws1.json)."""
    rows = []
    for r in _load("grad-ws1.json")["results"]:
        g, fl = r["graph"], r["floor"]
        rows.append([GRAD_ROWS[r["config"]], f"{_us(g['dispatch'])} + {_us(g['combine'])}",
                     f"{_us(g['combine_backward'])} + {_us(g['dispatch_backward'])}", f"{r['ratio']:.2f}×",
                     f"{_us(fl['forward'])} / {_us(fl['backward'])}",
                     f"{fl['backward']['median_us'] / r['forward_us']:.2f}×"])
    return _caption("grad-ws1.json") + _table(
        ["R1 shapes", "dispatch + combine", "combine_backward + dispatch_backward", "backward / forward",
         "memory patterns alone: forward / backward", "backward's patterns / forward"], rows)


def deep_ep():
    """moecomm.compat.deep_ep at world size 1 (deep-ep-ws1.json): the low-latency pair at DeepEP's test shape,
    eager and from a CUDA graph; the normal mode's phases beside their memory pattern."""
    results = _load("deep-ep-ws1.json")["results"]
    rows = [[f"{r['tokens']} tokens, hidden {r['hidden']}, {r['experts']} experts, top-{r['topk']}, FP8 dispatch",
             _with_p99({"median_us": r["eager_pair_us"], "p99_us": r["eager_pair_p99_us"]}), _us(r["host_pair_us"]),
             _with_p99({"median_us": r["graph_pair_us"], "p99_us": r["graph_pair_p99_us"]}),
             _us(r["deep_ep_test_avg_us"]) if "deep_ep_test_avg_us" in r else "-"]
            for r in results if r["mode"] == "low_latency"]
    normal = [[f"{r['phase']}, {r['dtype']}: {r['tokens']} tokens, hidden {r['hidden']}, top-{r['topk']} of "
               f"{r['experts']} ({r['rows']} rows)", _with_p99({"median_us": r["us"], "p99_us": r["p99_us"]}),
               _with_p99({"median_us": r["pattern_us"], "p99_us": r["pattern_p99_us"]}),
               f"{r['us'] / r['pattern_us']:.2f}×", _us(r["eager_us"])]
              for r in results if r["mode"] == "normal"]
    return _caption("deep-ep-ws1.json") + _table(
        ["DeepEP low-latency pair, world size 1", "eager (p99)", "host time", "CUDA graph (p99)",
         "DeepEP's own test, eager (mean)"], rows) + ("\n" + _table(
        ["DeepEP normal mode, world size 1", "device time (p99)", "the rows copied once (p99)", "ratio",
         "eager (host included)"], normal) if normal else "")


def dispatch_wire():
    """The quantising dispatch against FP8 tokens given, R1-decode at world size 1, rounds interleaved
    (ws1-dispatch-wire.json)."""
    res = _load("ws1-dispatch-wire.json")["results"]
    graph = {w: [r["graph"]["total"]["median_us"] for r in res if r["dispatch_wire"] == w] for w in WIRES}
    alone = {w: [r["graph"]["dispatch_send"]["median_us"] for r in res if r["dispatch_wire"] == w] for w in WIRES}
    given = statistics.median(graph[None])
    rows = [[label, " / ".join(_us(v) for v in graph[w]), " / ".join(_us(v) for v in alone[w]),
             "" if w is None else f"+{statistics.median(graph[w]) - given:.2f}"] for w, label in WIRES.items()]
    return _caption("ws1-dispatch-wire.json") + _table(
        ["R1-decode tokens", "CUDA graph, dispatch + combine (each round)", "dispatch alone (each round)",
         "over FP8 given (medians of the rounds)"], rows)


def sm_budget():
    """max_sms: the kernels alone and what a GEMM on another stream keeps of its solo speed beside them, world
    size 1 (ws1-sm-budget.json)."""
    res = _load("ws1-sm-budget.json")["results"]
    budgets = list(dict.fromkeys(r["max_sms"] for r in res))
    cell = {(r["config"], r["max_sms"]): f"{_with_p99(r['ours_alone'])}, {r['gemm_kept']:.0%}" for r in res}
    rows = [["None (whole GPU)" if b is None else str(b), cell[("r1-decode", b)], cell[("r1-prefill", b)]]
            for b in budgets]
    return _caption("ws1-sm-budget.json") + _table(
        ["`max_sms`", "R1-decode: ours alone, µs (p99), GEMM keeps", "R1-prefill: ours alone, µs (p99), GEMM keeps"],
        rows)


PATTERNS = {"fanout": "dispatch: each token row written into its expert rows", "landing_dispatch":
            "dispatch: the peer's records landing", "sum4": "combine, expert side: rows summed four at a time",
            "sum5": "combine, token side: rows summed five at a time", "sum8": "combine: a token's eight rows summed",
            "landing_combine": "combine: the peer's partial sums landing", "copy_1GiB": "a 1 GiB copy"}


def hbm():
    """R1-prefill's memory patterns per phase, plain kernels alone, and the same bytes at a 1 GiB copy's rate
    (hbm-floor.json)."""
    rows = []
    for run in _load("hbm-floor.json")["runs"]:
        where = "EP2 (a rank's share)" if run["world_size"] == 2 else "world size 1"
        copy_rate = run["patterns"]["copy_1GiB"]["TBps"]
        for key, stat in run["patterns"].items():
            if key != "copy_1GiB":
                rows.append([where, PATTERNS[key], f"{stat['bytes'] / 1e6:.1f}", _us(stat), f"{stat['TBps']:.2f}",
                             _us(stat["bytes"] / copy_rate / 1e6)])
        for phase in ("dispatch", "combine"):
            rows.append([where, f"{phase}: its patterns in sequence", "", _us(run["floors_us"][phase]), "",
                         _us(run["copy_floors_us"][phase])])
        rows.append([where, "a 1 GiB copy (the rate of the last column)", "", "", f"{copy_rate:.2f}", ""])
    return _caption("hbm-floor.json") + _table(
        ["where", "pattern", "MB", "plain kernel, µs", "TB/s", "at the copy's rate, µs"], rows)


def exchange():
    """Two bare exchanges of a small batch's rows at EP2, per protocol and transport (exchange-floor-*.json)."""
    rows = []
    for transport in ("ipc", "nvshmem"):
        res = _load(f"exchange-floor-{transport}.json")["results"]
        for tokens in ("1", "128"):
            rows.append([transport, tokens, _with_p99(res["fence"][tokens]), _with_p99(res["ll"][tokens]),
                         _us(res["launch_floor"])])
    return _caption("exchange-floor-ipc.json") + _table(
        ["transport", "tokens per rank", "fence (moecomm's protocol)", "LL (NCCL's)", "graph launch floor"], rows)


TABLES = {f.__name__: f for f in (ep2, ws1, host, jax, grads, dispatch_wire, deep_ep, sm_budget, hbm, exchange)}


def render(text):
    """``text`` with every figures block rendered from the results."""
    def one(m):
        name = m.group("name")
        if name not in TABLES:
            raise SystemExit(f"figures: unknown block {name!r} (known: {', '.join(TABLES)})")
        return m.group(1) + TABLES[name]() + m.group(4)
    return BLOCK.sub(one, text)


def stale():
    """[(file, block name)] of the blocks whose text differs from the results."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in BLOCK.finditer(text):
            if TABLES[m.group("name")]() != m.group("body"):
                out.append((path.relative_to(ROOT).as_posix(), m.group("name")))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only name the blocks that differ; exit 1 if any")
    args = p.parse_args()
    if args.check:
        bad = stale()
        for path, name in bad:
            print(f"{path}: figures block {name!r} differs from benchmarks/results/ (python tools/figures.py)")
        sys.exit(1 if bad else 0)
    for path in DOCS:
        path.write_text(render(path.read_text()))


if __name__ == "__main__":
    main()
