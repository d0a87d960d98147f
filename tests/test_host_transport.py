"""The host transport across real MPI ranks against the reference (tests/mpi_alltoall.py does the checks)."""
import pytest

from conftest import FULL, run_mpi


@pytest.mark.parametrize("ranks", [1, 2, 3, pytest.param(4, marks=FULL)], ids=lambda n: f"ranks{n}")
def test_sweep_matches_reference(ranks):
    p = run_mpi(ranks, "tests/mpi_alltoall.py", "--transport", "host", *(["--quick"] if ranks > 2 else []))
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert ": 0 failures" in p.stdout


def test_skipped_rank_times_out(tmp_path):
    report = tmp_path / "report.txt"
    p = run_mpi(3, "tests/mpi_timeout.py", "--transport", "host", "--result", str(report), timeout=120)
    text = report.read_text() if report.exists() else ""
    assert "CommTimeout on 2 ranks" in text, text + p.stdout[-4000:] + p.stderr[-4000:]
    assert "peer 2, phase dispatch" in text


def test_failed_calls_are_collective_and_out_of_step_calls_refused():
    """tests/mpi_control.py: a bad argument at each position raises on every rank and the next call is
    right; spellings of one configuration agree; AllToAlls met out of order raise OutOfStep everywhere."""
    p = run_mpi(3, "tests/mpi_control.py", timeout=120)
    assert p.returncode == 0 and ": 0 failures" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


def test_failed_calls_at_one_rank_leave_the_next_call_right():
    """tests/mpi_control.py at one rank (as GPUs run their local path there): every check that needs no other
    rank, each failed call followed by a right one."""
    p = run_mpi(1, "tests/mpi_control.py", timeout=120)
    assert p.returncode == 0 and ": 0 failures" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


def test_a_rank_that_skips_a_numbered_call_is_named_not_paired():
    """tests/mpi_call_ids.py on 3 host ranks: with call ids, a rank that skips a call raises OutOfStep on every
    rank (naming the program's calls) instead of pairing its next call with the peers' call."""
    p = run_mpi(3, "tests/mpi_call_ids.py", timeout=120)
    assert p.returncode == 0 and ": 0 failures" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


def test_a_masked_dead_rank_leaves_the_survivors_serving():
    """tests/mpi_mask.py: the survivors name the stalled rank, mask it, match the reference without its
    experts (and count the pairs not sent), then take it back."""
    p = run_mpi(3, "tests/mpi_mask.py", timeout=120)
    assert p.returncode == 0 and ": 0 failures" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


def test_routing_telemetry_example(tmp_path):
    """examples/routing_telemetry.py on 2 host ranks: metrics printed, Prometheus text written, a plan."""
    prom = tmp_path / "routing.prom"
    check_telemetry_example(run_mpi(2, "examples/routing_telemetry.py", "--steps", "30", "--prom", str(prom),
                                    timeout=120), prom)


def check_telemetry_example(p, prom):
    """examples/routing_telemetry.py's run ``p`` (``--prom prom``): it printed the metrics and a plan, and wrote the
    Prometheus text (or said it could not: no prometheus_client)."""
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "imbalance max/mean rank load per step" in p.stdout and "planned" in p.stdout, p.stdout[-3000:]
    assert prom.exists() and "moecomm_imbalance" in prom.read_text() or "no Prometheus text" in p.stdout


def test_load_tool_runs_every_scenario(tmp_path):
    """python -m moecomm.loadtest on 2 host ranks, small sizes: every scenario reports, the stalled rank of
    'mask' is named and masked, the TP all-reduce beside EP traffic leaves both right, and the JSON holds
    per-step records."""
    import json
    out = tmp_path / "load.json"
    p = run_mpi(2, "moecomm/loadtest.py", "--scenarios",
                "uniform,zipf,moving-hot,mixture,adversarial,ramp,topk,capacity,tp,mask",
                "--steps", "12", "--tokens", "16", "--experts", "16", "--topk", "4", "--hidden", "128", "--lengths",
                "mixture", "--timeout", "1", "--spare-slots", "1", "--replan", "4", "--json", str(out), timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    got = [r["scenario"] for r in doc["results"]]
    assert got == ["uniform", "zipf", "moving-hot", "mixture", "adversarial", "ramp", "topk", "capacity", "tp",
                   "mask"], got
    zipf = doc["results"][1]
    assert len(zipf["per_step"]["time_us"]) == 12 and zipf["imbalance"]["max"] >= 1.0
    assert [pt["tokens"] for pt in doc["results"][5]["points"]] == [1, 2, 4, 8, 16]
    assert "CommTimeout naming rank 1" in doc["results"][9]["detected"]
    tp = doc["results"][8]  # a TP2 all-reduce (MPI's, CPU ranks) beside every EP step
    assert tp["collective"] == "host" and tp["outputs_equal"] and tp["all_reduce_right"], tp
    shares = [pt["dropped_share"] for pt in doc["results"][7]["points"]]  # capacity 1x, 1.5x, 2x, 4x
    assert shares == sorted(shares, reverse=True) and shares[-1] < shares[0], shares
    assert doc["results"][4]["target"]["hit_rate"] >= 0.95
    domains = doc["results"][3]["domains"]  # the mixture's tokens tagged by domain, counted per tag
    assert [d["domain"] for d in domains] == [0, 1, 2, 3] and abs(sum(d["share"] for d in domains) - 1) < 1e-9
    replicas = zipf["replicas"]  # the same steps with planned replicas, switched every 4 steps
    assert replicas["slots_per_rank"] == 9 and replicas["switches"] == 2 and len(replicas["per_step"]["time_us"]) == 12
    gemm = zipf["gemm"]  # each local expert's GEMM against the tokens it received, every (step, expert)
    assert sum(b["expert_steps"] for b in gemm["by_tokens"]) == 12 * 16 and gemm["rank_total_us"]["p50"] > 0
    assert zipf["layer_time_us"]["p50"] >= zipf["time_us"]["p50"]


def test_load_tool_stops_each_expert_owner_in_turn(tmp_path):
    """The owners scenario on 3 host ranks: every rank stopped in turn with a second replica of each expert on
    another rank: no pair lost and every survivor's output equal to its run of the same steps before the stop;
    mask and owners together are refused (each leaves the communicator serving only through masked AllToAlls)."""
    import json
    out = tmp_path / "owners.json"
    p = run_mpi(3, "moecomm/loadtest.py", "--scenarios", "owners", "--steps", "6", "--tokens", "8", "--experts", "12",
                "--topk", "3", "--hidden", "64", "--no-gemm", "--json", str(out),
                timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    stops = json.loads(out.read_text())["results"][0]["stops"]
    assert [s["stopped"] for s in stops] == [0, 1, 2]
    assert all(s["pairs_lost"] == 0 and s["outputs_equal"] for s in stops), stops
    p = run_mpi(2, "moecomm/loadtest.py", "--scenarios", "mask,owners", timeout=60)
    assert p.returncode != 0 and "separate invocations" in p.stderr, p.stderr[-2000:]


@pytest.mark.parametrize("ranks", [2, 3], ids=lambda n: f"ranks{n}")
def test_replicated_experts_through_an_expert_map(ranks):
    """tests/mpi_replicas.py: one replica per pair, counts and combine equal the reference, a planned map
    switched between calls, a generation mismatch raised everywhere, differing maps refused."""
    p = run_mpi(ranks, "tests/mpi_replicas.py", timeout=120)
    assert p.returncode == 0 and ": 0 failures" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]


@pytest.mark.parametrize("ranks", [2, 3], ids=lambda n: f"ranks{n}")
def test_rows_grouped_by_source(ranks):
    """tests/mpi_packed.py: the packed layout's rows and the padded layout's with group_by_source hold each
    source's rows of an expert where the reference has them, for every dtype; combine through them is right; a
    capacity (per rank, per expert) drops the reference's pairs, or raises on every rank."""
    p = run_mpi(ranks, "tests/mpi_packed.py", timeout=120)
    assert p.returncode == 0 and ": 0 failures" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]


@pytest.mark.parametrize("ranks", [1, 3], ids=lambda n: f"ranks{n}")
def test_the_ranks_layout(ranks):
    """tests/mpi_ranks.py: layout='ranks' (DeepEP's normal mode) places each token once per rank, sources in rank
    order and each in token order, as moecomm.reference.dispatch_by_rank does, for bf16, FP8 with scales and a
    quantising dispatch; row_routing, a second dispatch of the same routing, combine's sums over ranks and its
    float32 side rows equal the reference's; refusals raise on every rank and the next call is right."""
    p = run_mpi(ranks, "tests/mpi_ranks.py", timeout=120)
    assert p.returncode == 0 and ": 0 failures" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]


@pytest.mark.parametrize("ranks", [2, 3], ids=lambda n: f"ranks{n}")
def test_capacity_policies(ranks):
    """tests/mpi_capacity.py: 'drop' counts and reports the dropped pairs exactly and combine equals the
    reference without them; 'error' raises CapacityExceeded on every rank and the next call is right."""
    p = run_mpi(ranks, "tests/mpi_capacity.py", timeout=120)
    assert p.returncode == 0 and ": 0 failures" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]


@pytest.mark.parametrize("ranks", [2, 3], ids=lambda n: f"ranks{n}")
def test_telemetry_equals_the_routing(ranks):
    """tests/mpi_telemetry.py: stats() window, tokens per expert, calls and bytes per peer equal counts computed
    from the routing over 40 skewed and uniform calls with split halves; timing; telemetry off."""
    p = run_mpi(ranks, "tests/mpi_telemetry.py", timeout=120)
    assert p.returncode == 0 and ": 0 failures" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]


@pytest.mark.parametrize("ranks", [1, 2, 3], ids=lambda n: f"ranks{n}")
def test_gradients_along_a_routing_plan(ranks):
    """tests/mpi_backward.py: dispatch_backward and combine_backward equal the reference for every dtype,
    both places of the router weights, m < max, DP groups, capacity drops, column-major scales with the FP8
    combine wire and the packed layout; a kept plan
    outlives another call; a refused backward argument raises on every rank and the next call is right."""
    p = run_mpi(ranks, "tests/mpi_backward.py", timeout=120)
    assert p.returncode == 0 and ": 0 failures" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]


@pytest.mark.parametrize("ranks", [1, 3], ids=lambda n: f"ranks{n}")
def test_formats_of_the_wire(ranks):
    """tests/mpi_formats.py: every scale format and layout and an NVFP4-shaped opaque payload round-trip
    bit-exactly through dispatch; the FP8 combine wire equals the reference's rounding, stays within the stated
    bound and sends fewer bytes."""
    p = run_mpi(ranks, "tests/mpi_formats.py", timeout=120)
    assert p.returncode == 0 and ": 0 failures" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
