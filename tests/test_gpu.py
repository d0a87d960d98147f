"""GPU tests: skipped without GPUs; on the GPU machine run with `python -m pytest tests/test_gpu.py`
(or `bash tools/gpu_check.sh`, which runs the same scripts and keeps their logs). The transport-level
tests run on both GPU transports (nvshmem, ipc)."""
import pytest

from conftest import NEEDS_GPU, check_exit_case, gpu_count, rank_records, run_mpi

GPUS = gpu_count()
needs_gpu = pytest.mark.skipif(GPUS < 1, reason=f"no GPU here; {NEEDS_GPU}")
each_transport = pytest.mark.parametrize("transport", ["nvshmem", "ipc"])


@needs_gpu
@each_transport
def test_peer_check(transport):
    p = run_mpi(GPUS, "tests/mpi_peer_check.py", timeout=300, env={"MOECOMM_TRANSPORT": transport})  # ends broken
    assert ": 0 failures" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


@needs_gpu
@each_transport
def test_alltoall_matches_reference(transport):
    p = run_mpi(GPUS, "tests/mpi_alltoall.py", "--transport", transport, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert ": 0 failures" in p.stdout


@needs_gpu
@each_transport
def test_model_sized_and_streamed_batches(transport):
    """R1-sized cases and prefill-sized batches that stream (arrival words, the streamed combine; on nvshmem from
    the ipc build, every peer being mapped: moecomm/transport/gpu_plan.py):
    ``tests/mpi_alltoall.py --full``; then capacity policies in an AllToAll of prefill size."""
    p = run_mpi(GPUS, "tests/mpi_alltoall.py", "--transport", transport, "--quick", "--full", timeout=600)
    assert p.returncode == 0 and ": 0 failures" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]
    p = run_mpi(GPUS, "tests/mpi_capacity.py", "--transport", transport, "--max-tokens", "2048", timeout=300)
    assert p.returncode == 0 and ": 0 failures" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


@pytest.mark.skipif(GPUS < 4, reason=f"DP groups with more than one EP group need >= 4 GPUs; {NEEDS_GPU}")
def test_dp_groups():
    p = run_mpi(GPUS, "tests/mpi_alltoall.py", "--transport", "nvshmem", "--dp-only", timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert ": 0 failures" in p.stdout


@needs_gpu
def test_network_path_with_puts_only():
    """Every peer treated as off-node (MOECOMM_FORCE_PUTS=1): the put path of the same kernels, the
    model-sized and streamed batches (moecomm_dispatch_streamed) included (--full)."""
    p = run_mpi(GPUS, "tests/mpi_alltoall.py", "--transport", "nvshmem", "--quick", "--full", timeout=600,
                env={"MOECOMM_FORCE_PUTS": "1"})
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert ": 0 failures" in p.stdout


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs; {NEEDS_GPU}")
@each_transport
@pytest.mark.parametrize("skip", [(), ("--skip", "dispatch", "--max-tokens", "2048"),
                                  ("--skip", "combine", "--max-tokens", "2048")],
                         ids=["dispatch", "streamed-dispatch", "combine"])
def test_skipped_rank_times_out(transport, skip):
    """A rank that skips dispatch, or at a prefill size dispatch (the streamed receive half: warp 0 waits for
    each record's arrival) or combine (the streamed combine's token side on ipc)."""
    p = run_mpi(GPUS, "tests/mpi_timeout.py", "--transport", transport, *skip, timeout=120)
    assert f"CommTimeout on {GPUS - 1} ranks" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs; {NEEDS_GPU}")
@each_transport
def test_failed_calls_are_collective(transport):
    """tests/mpi_control.py on GPUs: refusals at each argument position, bad routing, a bound_m that differs,
    a second dispatch: every rank raises by the end of the call and the next call is right."""
    p = run_mpi(GPUS, "tests/mpi_control.py", "--transport", transport, timeout=300)  # ends broken by design
    assert ": 0 failures" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


@needs_gpu
@each_transport
def test_failed_calls_at_one_rank_leave_the_next_call_right(transport):
    """tests/mpi_control.py at one rank (the local path, cuda/local.cu): a refused or failed call writes
    nothing it should not and the next call is right."""
    p = run_mpi(1, "tests/mpi_control.py", "--transport", transport, timeout=300)
    assert p.returncode == 0 and ": 0 failures" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


@needs_gpu
@each_transport
@pytest.mark.parametrize("again", ["dispatch", "combine"])
def test_a_call_replayed_out_of_order_raises_on_every_rank(transport, again):
    """A dispatch or a combine replayed twice from a CUDA graph (tests/mpi_control.py --replay; one rank takes
    the local path): OutOfStep on every rank, a combine's out_tokens untouched; ends broken by design."""
    p = run_mpi(GPUS, "tests/mpi_control.py", "--transport", transport, "--replay", again, timeout=120)
    assert ": 0 failures" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs; {NEEDS_GPU}")
@each_transport
def test_a_masked_dead_rank_leaves_the_survivors_serving(transport):
    p = run_mpi(GPUS, "tests/mpi_mask.py", "--transport", transport, timeout=300)  # ends broken by design
    assert ": 0 failures" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


FAULT_POINTS = ("init", "construction", "dispatch_send", "dispatch_recv", "combine_send", "combine_recv",
                "dispatch_backward", "combine_backward", "destroy", "finalize")


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs; {NEEDS_GPU}")
@pytest.mark.parametrize("fault", FAULT_POINTS)
@each_transport
def test_a_rank_that_stalls_is_named(tmp_path, fault, transport):
    """tests/mpi_faults.py on GPUs: the last rank stalls at ``fault``; the others raise CommTimeout naming it
    within the timeout + 1 s of the step that noticed (Open MPI ends the job when a rank leaves, so the
    faulty rank stalls instead of exiting)."""
    import json
    timeout = 1.0
    p = run_mpi(GPUS, "tests/mpi_faults.py", "--transport", transport, "--fault", fault, "--mode", "stall",
                "--timeout", str(timeout), "--result", str(tmp_path), timeout=180)
    records = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("rank*.json"))]
    log = p.stdout[-3000:] + p.stderr[-3000:]
    assert len(records) == GPUS - 1, log
    for r in records:
        assert r["raised"] == "CommTimeout" and r["peer"] == GPUS - 1 and r["after_s"] <= timeout + 1, (r, log)


@needs_gpu
@each_transport
def test_demo_on_gpus(transport):
    p = run_mpi(GPUS, "examples/demo.py", "--transport", transport, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


def _has(module):
    import importlib.util
    return importlib.util.find_spec(module) is not None


needs_torch = pytest.mark.skipif(GPUS < 1 or not _has("torch"),
                                 reason=f"needs a GPU and torch's CUDA build; {NEEDS_GPU}")


@needs_torch
def test_torch_tensors_as_they_are():
    """The sweep with PyTorch tensors of the real dtypes (bf16, fp16, fp8, int64 and uint32 ids, ...)."""
    p = run_mpi(GPUS, "tests/mpi_alltoall.py", "--transport", "nvshmem", "--arrays", "torch", "--quick",
                timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert ": 0 failures" in p.stdout


@needs_gpu
def test_raw_device_buffers():
    p = run_mpi(GPUS, "tests/mpi_alltoall.py", "--transport", "nvshmem", "--arrays", "buffer", "--quick",
                timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert ": 0 failures" in p.stdout


@pytest.mark.skipif(GPUS < 2 or not (_has("torch") and _has("jax")), reason=f"needs 2 GPUs, torch and jax; {NEEDS_GPU}")
def test_embedding_devices_and_streams():
    """Another current device, late producers on side streams (torch, __dlpack__, CuPy, JAX), stream kinds."""
    p = run_mpi(GPUS, "tests/mpi_embedding.py", timeout=300)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert ": 0 failures" in p.stdout


@needs_torch
def test_torch_example_in_a_cuda_graph():
    p = run_mpi(GPUS, "examples/torch_moe.py", timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "all ranks match" in p.stdout


@pytest.mark.skipif(GPUS < 1 or not _has("jax"), reason=f"needs a GPU and jax; {NEEDS_GPU}")
@pytest.mark.parametrize("order", [[], ["--jax-first"]], ids=["jax-after-init", "jax-before-init"])
def test_jax_example_jitted(order):
    p = run_mpi(GPUS, "examples/jax_moe.py", *order, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "all ranks match" in p.stdout


@pytest.mark.skipif(GPUS < 1 or not _has("jax"), reason=f"needs a GPU and jax; {NEEDS_GPU}")
@pytest.mark.parametrize("preallocate", ["false", "true"])
def test_jitted_jax_steps_replay_with_no_python_per_call(preallocate):
    """tools/jax_step.py --small --require-captured at world size 1 over ipc: every layer (the exchange, x 2 in
    XLA between the halves, the whole MoE layer in bf16 and FP8, its training step under jax.checkpoint),
    unrolled and scanned, checked first, then no handler run (Python) in the timed steps; with JAX's memory
    preallocated and not."""
    p = run_mpi(1, "tools/jax_step.py", "--small", "--require-captured", "--steps", "20", "--rounds", "1",
                "--json", "/dev/null", timeout=900,
                env={"MOECOMM_TRANSPORT": "ipc", "XLA_PYTHON_CLIENT_PREALLOCATE": preallocate})
    assert p.returncode == 0 and "train " in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


@needs_torch
def test_started_from_torch_distributed():
    import os
    import subprocess
    import sys
    from conftest import ROOT
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(GPUS),
                        str(ROOT / "tests/torchrun_bootstrap.py")], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert ": 0 failures" in p.stdout


@needs_gpu
@each_transport
@pytest.mark.parametrize("script", ["mpi_telemetry.py", "mpi_capacity.py", "mpi_replicas.py", "mpi_packed.py"])
def test_operating_under_skew(transport, script):
    """Telemetry (with split halves and CUDA-graph replay), capacity policies, replicated experts behind an
    expert map and the packed layout, in the kernels: the same scripts as on the host transport."""
    p = run_mpi(GPUS, f"tests/{script}", "--transport", transport, timeout=300)
    assert p.returncode == 0 and ": 0 failures" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


@needs_gpu
@pytest.mark.parametrize("script", ["mpi_telemetry.py", "mpi_capacity.py", "mpi_replicas.py", "mpi_packed.py"])
def test_operating_under_skew_through_puts_only(script):
    """The same with every peer treated as off-node (MOECOMM_FORCE_PUTS=1): drop words and failure details
    through NVSHMEM puts."""
    p = run_mpi(GPUS, f"tests/{script}", "--transport", "nvshmem", timeout=300, env={"MOECOMM_FORCE_PUTS": "1"})
    assert p.returncode == 0 and ": 0 failures" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


# Every program of the never-silent, gradient, format, framework and DeepEP suites: at one rank on each GPU transport,
# and at 2, 4 (and 8) ranks sharing GPU 0 over ipc (time-sliced: correct, slow; their semantics where one GPU is lent).
# `bash tools/gpu_check.sh MODE` runs its selection of these and the tests above (its suite() helper).
SHARED_GPU = {"CUDA_VISIBLE_DEVICES": "0", "MOECOMM_TRANSPORT": "ipc", "MOECOMM_IPC_HEAP_MB": "1024",
              "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
TRANSPORT = ("--transport", "{t}")
PROGRAMS = (  # (the program and its arguments ("{t}": the transport), one-rank transports, shared ranks, needs)
    (("tests/mpi_recovery.py", *TRANSPORT), ("ipc", "nvshmem"), (2, 4), ()),
    (("tests/mpi_alltoall.py", *TRANSPORT, "--quick"), (), (2, 4, 8), ()),
    (("tests/mpi_alltoall.py", *TRANSPORT, "--dp-only"), (), (4,), ()),
    (("tests/mpi_control.py", *TRANSPORT), (), (2, 4, 8), ()),
    (("tests/mpi_control.py", *TRANSPORT, "--replay", "dispatch"), (), (2, 4), ()),
    (("tests/mpi_control.py", *TRANSPORT, "--replay", "combine"), (), (2, 4), ()),
    (("tests/mpi_threads.py", *TRANSPORT), (), (2, 4), ()),
    (("tests/mpi_call_ids.py", *TRANSPORT), (), (2, 4), ()),
    (("tests/mpi_call_ids.py", *TRANSPORT, "--jax"), (), (2, 4), ("jax",)),
    (("tests/mpi_backward.py", *TRANSPORT), ("ipc", "nvshmem"), (2, 4), ()),
    (("tests/mpi_formats.py", *TRANSPORT), ("ipc", "nvshmem"), (2, 4), ()),
    (("tests/mpi_telemetry.py", *TRANSPORT), (), (2,), ()),
    (("tests/mpi_capacity.py", *TRANSPORT), (), (2,), ()),
    (("tests/mpi_packed.py", *TRANSPORT), (), (2,), ()),
    (("tests/mpi_ranks.py", *TRANSPORT), ("ipc", "nvshmem"), (2, 4), ()),
    (("tests/mpi_replicas.py", *TRANSPORT), (), (2,), ()),
    (("tests/mpi_mask.py", *TRANSPORT), (), (4,), ()),
    (("tests/mpi_jax.py",), ("ipc",), (2, 4), ("jax",)),
    (("tests/mpi_jax_grad.py", *TRANSPORT), ("ipc", "nvshmem"), (2, 4), ("jax",)),
    (("tests/mpi_jax_spmd.py",), ("ipc",), (2,), ("jax",)),
    (("tests/mpi_jax_errors.py",), ("ipc",), (2,), ("jax",)),
    (("tests/mpi_jax_errors.py", "--silent"), (), (2,), ("jax",)),
    (("tests/mpi_torch_grad.py", *TRANSPORT), ("ipc", "nvshmem"), (2, 4), ("torch",)),
    (("tests/mpi_deep_ep.py", *TRANSPORT), ("ipc", "nvshmem"), (2,), ("torch",)),
    (("tests/mpi_deep_ep_normal.py", *TRANSPORT), ("ipc", "nvshmem"), (2, 4), ("torch",)),
)


def _run_id(program, ranks, transport):
    """mpi_control-replay-dispatch-2-shared, mpi_recovery-1-nvshmem, ..."""
    words = [a.lstrip("-") for a in program[1:] if a not in TRANSPORT]
    name = program[0].rpartition("/")[2].removesuffix(".py")
    return "-".join([name, *words, str(ranks), transport or "shared"])


RUNS = [pytest.param(program, ranks, transport, needs, id=_run_id(program, ranks, transport))
        for program, ones, shared, needs in PROGRAMS
        for ranks, transport in [(1, t) for t in ones] + [(n, None) for n in shared]]


@pytest.mark.parametrize("program, ranks, transport, needs", RUNS)
def test_gpu_program(program, ranks, transport, needs):
    """One program of PROGRAMS: at one rank on ``transport``, or (transport None) on ``ranks`` ranks sharing GPU 0
    over ipc; it prints "<n> checks on <w> ranks: 0 failures" (some end with the communicator broken by design, so
    the launcher's exit status is not theirs)."""
    if GPUS < 1:
        pytest.skip(f"no GPU here; {NEEDS_GPU}")
    missing = [m for m in needs if not _has(m)]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    args = [a.replace("{t}", transport or "ipc") for a in program]
    env = SHARED_GPU if transport is None else dict(MOECOMM_TRANSPORT=transport, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    p = run_mpi(ranks, *args, timeout=600, env=env)
    assert ": 0 failures" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


@needs_gpu
def test_a_rank_whose_program_fails_is_named_at_once(tmp_path):
    """tests/mpi_faults.py on 3 ranks sharing GPU 0: the last rank's program raises (unhandled) in its dispatch; the
    others raise PeerExited naming it, with its exception, within about a second although their timeout is 10 s."""
    p = run_mpi(3, "tests/mpi_faults.py", "--transport", "ipc", "--fault", "dispatch_send", "--mode", "raise",
                "--timeout", "10", "--result", str(tmp_path), timeout=120, env=SHARED_GPU, keep_going=True)
    records, log = rank_records(tmp_path, 2), p.stdout[-3000:] + p.stderr[-3000:]
    assert len(records) == 2, log
    for r in records.values():
        assert r["raised"] == "PeerExited" and r["peer"] == 2, (r, log)
        assert "injected fault" in r["reason"] and r["after_s"] <= 1.5, (r, log)


@needs_gpu
@pytest.mark.parametrize("case", ["destroy", "leave", "finalize"])
def test_the_exit_cases_on_a_shared_gpu(tmp_path, case):
    """tests/mpi_recovery.py's exit cases on 2 ranks sharing GPU 0 over ipc (a send half posted at destroy, a rank
    leaving main() with its communicator local, the rank that finalized first), judged by the ranks' records
    (conftest.check_exit_case): the launcher counts a rank's os._exit as a failure."""
    p = run_mpi(2, "tests/mpi_recovery.py", "--transport", "ipc", "--case", case, "--result", str(tmp_path),
                timeout=120, env=SHARED_GPU, keep_going=True)
    log = p.stdout[-3000:] + p.stderr[-3000:]
    assert "Segmentation" not in log, log
    check_exit_case(case, rank_records(tmp_path, 2), log)


@needs_gpu
def test_routing_telemetry_example_on_gpus(tmp_path):
    """examples/routing_telemetry.py at one rank a GPU (the kernels' telemetry): metrics printed, Prometheus text
    written (or said to be skipped without prometheus_client), a replica plan."""
    prom = tmp_path / "routing.prom"
    from test_host_transport import check_telemetry_example
    check_telemetry_example(run_mpi(GPUS, "examples/routing_telemetry.py", "--prom", str(prom), timeout=300), prom)


@needs_gpu
def test_backward_through_puts_only():
    """tests/mpi_backward.py with every peer treated as off-node (MOECOMM_FORCE_PUTS=1): the backward kernels'
    put path."""
    p = run_mpi(GPUS, "tests/mpi_backward.py", "--transport", "nvshmem", timeout=600, env={"MOECOMM_FORCE_PUTS": "1"})
    assert ": 0 failures" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


@needs_gpu
@pytest.mark.skipif(not _has("torch"), reason="needs torch")
def test_deep_ep_pair_eager_and_in_a_graph():
    """tools/deep_ep_bench.py at DeepEP's test shape (checked against the dense result, eager and replayed from a
    CUDA graph, before it times anything)."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        p = run_mpi(1, "tools/deep_ep_bench.py", "--iters", "20", "--json", f"{tmp}/deep-ep.json", timeout=300,
                    env={"MOECOMM_TRANSPORT": "ipc"})
    assert p.returncode == 0 and '"graph_pair_us"' in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


@needs_gpu
@each_transport
def test_the_readme_gpu_program_runs(tmp_path, transport):
    """README's GPU first program (CuPy) at one rank a GPU, on each transport."""
    from test_readme import _block
    script = tmp_path / "gpu_first.py"
    script.write_text(_block("gpu snippet").replace('transport="ipc"', f'transport="{transport}"'))
    p = run_mpi(GPUS, str(script), timeout=300)
    assert p.returncode == 0 and p.stdout.count("combine matches") == GPUS, p.stdout[-3000:] + p.stderr[-3000:]
