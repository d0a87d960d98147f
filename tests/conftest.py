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


def mpi_launcher(keep_going=False):
    """mpiexec/mpirun as a command list: the one beside this Python first (pip's mpich), else PATH. With
    ``keep_going`` the job outlives a rank that ends without MPI's finalization (a program that breaks its
    communicator by design): Open MPI's ``--mca orte_abort_on_non_zero_status 0``, MPICH's
    ``-disable-auto-cleanup``; the launcher's exit status then is not the programs', so judge their records."""
    beside = Path(sys.executable).parent
    exe = next((str(beside / n) for n in ("mpiexec", "mpirun") if (beside / n).exists()), None)
    exe = exe or shutil.which("mpiexec") or shutil.which("mpirun")
    if exe is None:
        pytest.skip("no mpiexec/mpirun found: pip install mpich (or install Open MPI)")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    cmd = [exe]
    open_mpi = "Open MPI" in version or "OpenRTE" in version
    if open_mpi:
        cmd += ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    if keep_going:
        cmd += ["--mca", "orte_abort_on_non_zero_status", "0"] if open_mpi else ["-disable-auto-cleanup"]
    return cmd


def run_mpi(n, script, *args, timeout=300, env=None, keep_going=False):
    """Run ``python script args`` on n ranks; return the completed process (output captured). Rank 0's report
    (tests/report.py) is also written to a file, added to the output where the launcher dropped it.
    ``keep_going``: as mpi_launcher's."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        written = Path(tmp, "report.txt")
        e = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                 PYTHONUNBUFFERED="1", MOECOMM_TEST_REPORT=str(written), **(env or {}))
        cmd = mpi_launcher(keep_going) + ["-n", str(n), sys.executable, str(ROOT / script), *args]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e, cwd=ROOT)
        if written.exists() and written.read_text() not in p.stdout:
            p.stdout += written.read_text()
    return p


def rank_records(folder, ranks):
    """{rank: record} of the ``folder/rank<r>.json`` files written by ranks 0 .. ranks - 1 (tests/mpi_faults.py,
    tests/mpi_recovery.py: what each rank raised, naming whom, after how long)."""
    import json
    return {r: json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(ranks)
            if Path(folder, f"rank{r}.json").exists()}


def check_exit_case(case, records, log):
    """tests/mpi_recovery.py --case ``case`` on 2 ranks, judged by the ranks' records: ``leave`` (rank 1 returns
    from main() with its communicator a local): rank 0 raised PeerExited within about a second; ``destroy`` and
    ``finalize``: both ranks wrote their record, and at ``finalize`` rank 1's call failed (PeerExited: rank 0
    finalized first) while rank 0's did not."""
    if case == "leave":
        assert records[0]["raised"] == "PeerExited" and records[0]["after_s"] <= 1.5, (records, log)
    else:
        assert len(records) == 2, log
    if case == "finalize":
        assert records[1]["raised"] == "PeerExited" and records[0]["raised"] is None, (records, log)


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
