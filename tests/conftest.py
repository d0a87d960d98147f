"""Shared test helpers: launching MPI jobs, knowing whether GPUs are here, and the full matrix.

The default run covers every layer once (the host transport at 1-3 ranks, the JAX and torch layers, one
build of every kernel variant) in a few minutes on two cores; ``python -m pytest tests --full`` adds the
rest of the matrix (every rank count, fault point and concurrency case), which CI (``.ci/run``) runs. A test
or case of the full matrix carries ``FULL`` (``pytest.param(..., marks=FULL)`` for one case)."""
import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FULL = pytest.mark.full
FULL_RUN = "python -m pytest tests --full"
NEEDS_GPU = ("on a machine with NVIDIA GPUs: python -m pytest tests/test_gpu.py (or bash tools/gpu_check.sh, "
             "which keeps the logs)")
TORCH_CPU = "pip install torch --index-url https://download.pytorch.org/whl/cpu (PyTorch's CPU build)"


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="also run the full matrix: every rank count, fault point and concurrency case (CI does)")


def pytest_configure(config):
    config.addinivalue_line("markers", f"full: part of the full matrix, run by {FULL_RUN}")


def pytest_make_parametrize_id(config, val, argname):
    """A string parameter's test id without spaces or quotes, so that every printed id can be passed back to
    pytest as it is (other values: pytest's own ids)."""
    if isinstance(val, str):
        return re.sub(r"[^\w.=+-]+", "_", val).strip("_")[:48]
    return None


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full"):
        return
    skip = pytest.mark.skip(reason=f"part of the full matrix: {FULL_RUN}")
    for item in items:
        if "full" in item.keywords:
            item.add_marker(skip)


def mpi_launcher():
    """mpiexec/mpirun as a command list: the one beside this Python first (pip's mpich), else PATH."""
    beside = Path(sys.executable).parent
    exe = next((str(beside / n) for n in ("mpiexec", "mpirun") if (beside / n).exists()), None)
    exe = exe or shutil.which("mpiexec") or shutil.which("mpirun")
    if exe is None:
        pytest.skip("no mpiexec/mpirun found: pip install mpich (or install Open MPI)")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    cmd = [exe]
    if "Open MPI" in version or "OpenRTE" in version:
        cmd += ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    return cmd


def run_mpi(n, script, *args, timeout=300, env=None):
    """Run ``python script args`` on n ranks; return the completed process (output captured). Rank 0's report
    (tests/report.py) is also written to a file, added to the output where the launcher dropped it."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        written = Path(tmp, "report.txt")
        e = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                 PYTHONUNBUFFERED="1", MOECOMM_TEST_REPORT=str(written), **(env or {}))
        cmd = mpi_launcher() + ["-n", str(n), sys.executable, str(ROOT / script), *args]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e, cwd=ROOT)
        if written.exists() and written.read_text() not in p.stdout:
            p.stdout += written.read_text()
    return p


def need(module, install):
    """``module`` imported, or the test (or, at a module's top, the module) skipped saying how to install it
    (``install``: a command)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        pytest.skip(f"needs {module}: {install}", allow_module_level=True)


def gpu_count():
    from moecomm.comm import gpu_count as count
    return count()
