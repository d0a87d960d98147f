"""The benchmark's host-side pieces (routing, statistics, the report table) on the CPU; the timings
themselves need GPUs (tools/gpu_check.sh bench)."""
import numpy as np
import pytest

from moecomm import bench


@pytest.mark.parametrize("kind", ["uniform", "zipf", "hot"])
def test_routing_is_valid_topk(kind):
    rng = np.random.default_rng(1)
    idx = bench.routing(rng, 64, 8, 256, kind)
    assert idx.shape == (64, 8) and idx.dtype == np.int32
    assert idx.min() >= 0 and idx.max() < 256
    assert all(len(set(row)) == 8 for row in idx.tolist())
    if kind == "hot":
        assert (idx == 0).any(axis=1).all()


def test_zipf_routing_is_skewed():
    counts = np.bincount(bench.routing(np.random.default_rng(2), 512, 8, 256, "zipf").ravel(), minlength=256)
    uniform = np.bincount(bench.routing(np.random.default_rng(2), 512, 8, 256, "uniform").ravel(), minlength=256)
    assert counts.max() > 3 * uniform.max()


def test_stats():
    s = bench.stats(np.arange(1, 101, dtype=float))
    assert s["median_us"] == 50.5 and s["n"] == 100 and 99 <= s["p99_us"] <= 100


def _result(tokens, graph=True, nccl=True):
    t = {p: bench.stats([1.0 + i]) for i, p in enumerate(bench.PHASES)}
    r = dict(config="r1-decode", tokens=tokens, eager=dict(t, total=bench.stats([10.0])), GBps_per_rank=12.5,
             eager_layer=bench.stats([7.0]),
             host_us={"cupy": {"dispatch": bench.stats([9.5]), "combine": bench.stats([8.25]),
                               "eager_layer": bench.stats([7.0])}})

    if graph:
        r["graph"] = dict(t, total=bench.stats([4.0]), split_total=bench.stats([5.5]))
    if nccl:
        r["nccl"] = {"exact": bench.stats([8.0]), "padded": bench.stats([9.0])}
        r["speedup_vs_nccl_exact"] = 2.0
    return r


def test_table_lists_totals_and_phases_alone():
    text = bench.table([_result(128), _result(1, graph=False, nccl=False)])
    lines = text.splitlines()
    assert lines[2].split()[:3] == ["nvshmem", "r1-decode", "128"] and "2.00" in lines[2]
    assert lines[2].split()[9:12] == ["4.0", "4.0", "5.5"]  # graph total, its p99, the four half calls
    assert "n/a" in lines[3]
    alone = lines[lines.index(next(line for line in lines if line.startswith("graph, each phase alone"))) + 2]
    assert alone.split() == ["nvshmem", "r1-decode", "128", "1.0", "2.0", "3.0", "4.0", "10.0"]


def test_table_lists_host_time_per_call():
    lines = bench.table([_result(128)]).splitlines()
    row = lines[lines.index(next(line for line in lines if line.startswith("host us per call"))) + 2]
    assert row.split() == ["nvshmem", "r1-decode", "128", "9.5/8.2", "7.0", "4.0"]  # d/c, the layer, the graph


def _cli(*args):
    import os
    import subprocess
    import sys
    from conftest import ROOT
    return subprocess.run([sys.executable, "-m", "moecomm.bench", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_cli_refuses_an_unknown_config_in_one_line():
    p = _cli("--configs", "nope")
    assert p.returncode == 2 and "unknown config 'nope'" in p.stderr and "Traceback" not in p.stderr


def test_cli_without_a_gpu_says_so():
    from conftest import gpu_count
    if gpu_count():
        pytest.skip("this machine has a GPU (this checks the CLI's message without one): run it on a CPU machine")
    p = _cli()
    assert p.returncode == 2 and "needs GPUs" in p.stderr and "Traceback" not in p.stderr


def test_merge_joins_runs_of_two_transports(tmp_path):
    """--merge (no GPU): results of one run per transport side by side, each naming its transport."""
    import json
    for name in ("nvshmem", "ipc"):
        doc = {"command": f"bench --transport {name}", "transport": name, "results": [_result(128)]}
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    p = _cli("--merge", str(tmp_path / "nvshmem.json"), str(tmp_path / "ipc.json"),
             "--json", str(tmp_path / "both.json"))
    assert p.returncode == 0, p.stderr
    both = json.loads((tmp_path / "both.json").read_text())
    assert [r["transport"] for r in both["results"]] == ["nvshmem", "ipc"]
    assert [r["transport"] for r in both["runs"]] == ["nvshmem", "ipc"]
    assert "ipc r1-decode" in p.stdout


def test_a_plot_asked_for_without_matplotlib_is_refused_at_once(tmp_path):
    """--plot needs matplotlib (the plot extra): without it the tool stops before measuring anything, saying so,
    instead of exiting 0 with no plot written."""
    import importlib.util
    if importlib.util.find_spec("matplotlib"):
        pytest.skip("matplotlib is installed here")
    p = _cli("--merge", str(tmp_path / "a.json"), "--plot", str(tmp_path / "a.png"))
    assert p.returncode == 2 and "needs matplotlib" in p.stderr, p.stdout + p.stderr


def _trace_tool():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "tools" / "trace_kernels.py"
    spec = importlib.util.spec_from_file_location("trace_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trace_figures_time_each_reached_stage():
    """tools/trace_kernels.py's arithmetic on synthetic stamps (the stamps themselves need a GPU): stages
    from the previous reached stamp, unreached stages left out, the stamping block's span, the last block's
    epilogue; and the kernel spans and the SM clock's rate from the global-timer stamps."""
    from moecomm import _constants as C
    tool = _trace_tool()
    mhz, replays = 1000.0, 5  # 1000 clocks per microsecond
    rows = np.zeros((replays, len(C.HALVES), C.TRACE_POINTS), np.int64)
    for h, half in enumerate(C.HALVES):
        n = len(tool.STAGES[half])
        rows[:, h, :n] = 10_000 + 1000 * np.arange(n) * (h + 1)  # each stage (h + 1) us after the last
    rows[:, 1, 2:4] = 0  # dispatch_recv's stamping block had no records: "routed" and "copied" unreached
    rows[:, 0, -1] = 1500  # dispatch_send's last block: 1.5 us of epilogue
    figures = tool.figures(rows, mhz)
    send = figures["dispatch_send"]
    assert send["first token routed (ids, slots)"] == [1.0, 1.0]
    assert send["stamping block, start to end"][0] == 5.0 and send["last block: signals, counters"][0] == 1.5
    recv = figures["dispatch_recv"]
    assert "first record routed (slots)" not in recv and "first record copied" not in recv
    assert recv["all records copied"] == [6.0, 6.0]  # from "source's signal seen": three stamps on, 2 us apart
    assert "last block: signals, counters" not in figures["combine_recv"]
    text = tool.table([figures, figures])
    assert "rank 1" in text and "first record copied" not in text
    rows[:, 3] = 0  # the local path: no kernel stamps combine_recv, whose half is then left out
    local = tool.figures(rows, mhz)
    assert "combine_recv" not in local and local["combine_send"] == figures["combine_send"]
    assert "combine_recv" not in tool.table([local])
    # kernel spans: the one-launch dispatch (slot of dispatch_send) and combine (combine_send) ran, 2 GHz
    spans = np.zeros((replays, 2 + len(C.HALVES) * C.TRACE_SPAN), np.int64)
    spans[:, 0], spans[:, 1] = 1_000_000, 1_030_000  # the stamps before and after the graph's kernels (ns)
    for h, start in ((0, 1_001_000), (2, 1_016_000)):
        s = spans[:, 2 + h * C.TRACE_SPAN:2 + (h + 1) * C.TRACE_SPAN]
        s[:, :4] = (start, start + 100, start + 12_000, start + 13_000)  # entries, exits
        s[:, 4:6] = (0, 2 * 12_000)  # block 0's clock: 24000 cycles ...
        s[:, 6:8] = (start, start + 12_000)  # ... in 12 us
    assert tool.spans_clock(spans) == 2e9
    tl = tool.timeline(spans)
    assert tl["dispatch_send kernel first entry"] == 1.0 and tl["combine_send kernel last exit"] == 29.0
    assert tl["stamp after"] == 30.0 and not any(k.startswith("dispatch_recv") for k in tl)


@pytest.mark.parametrize("tool", ["hbm_floor.py", "exchange_floor.py"])
def test_floor_tools_load_and_describe_themselves(tool):
    """tools/hbm_floor.py and tools/exchange_floor.py measure on GPUs only (tools/gpu_check.sh floors); here:
    they import without one and their usage names what they measure."""
    import subprocess
    import sys
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "tools" / tool
    p = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "floor" in p.stdout and "--json" in p.stdout


def test_host_ab_describes_itself():
    """tools/host_ab.py (host time of two trees, interleaved, on a GPU) loads without a GPU and says what it does."""
    import subprocess
    import sys
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "tools" / "host_ab.py"
    p = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "--base" in p.stdout, p.stderr
