"""GPU tests: skipped without GPUs; on the GPU machine run with `python -m pytest tests/test_gpu.py`
(or `bash tools/gpu_check.sh`, which runs the same scripts and keeps their logs)."""
import pytest

from conftest import gpu_count, run_mpi

GPUS = gpu_count()
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="no GPU")


@needs_gpu
def test_peer_check():
    p = run_mpi(GPUS, "tests/mpi_peer_check.py", timeout=300)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert ": 0 failures" in p.stdout


@needs_gpu
def test_alltoall_matches_reference():
    p = run_mpi(GPUS, "tests/mpi_alltoall.py", "--transport", "nvshmem", timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert ": 0 failures" in p.stdout


@pytest.mark.skipif(GPUS < 4, reason="DP groups with more than one EP group need >= 4 GPUs")
def test_dp_groups():
    p = run_mpi(GPUS, "tests/mpi_alltoall.py", "--transport", "nvshmem", "--dp-only", timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert ": 0 failures" in p.stdout


@needs_gpu
def test_network_path_with_puts_only():
    """Every peer treated as off-node (MOECOMM_FORCE_PUTS=1): the put path of the same kernels."""
    p = run_mpi(GPUS, "tests/mpi_alltoall.py", "--transport", "nvshmem", "--quick", timeout=600,
                env={"MOECOMM_FORCE_PUTS": "1"})
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert ": 0 failures" in p.stdout


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_skipped_rank_times_out():
    p = run_mpi(GPUS, "tests/mpi_timeout.py", "--transport", "nvshmem", timeout=120)
    assert f"CommTimeout on {GPUS - 1} ranks" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


@needs_gpu
def test_demo_on_gpus():
    p = run_mpi(GPUS, "examples/demo.py", "--transport", "nvshmem", timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
