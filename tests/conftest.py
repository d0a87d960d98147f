"""Shared test helpers: launching MPI jobs and knowing whether GPUs are here."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def mpi_launcher():
    """mpiexec/mpirun as a command list: the one beside this Python first (pip's mpich), else PATH."""
    beside = Path(sys.executable).parent
    exe = next((str(beside / n) for n in ("mpiexec", "mpirun") if (beside / n).exists()), None)
    exe = exe or shutil.which("mpiexec") or shutil.which("mpirun")
    if exe is None:
        pytest.skip("no mpiexec/mpirun found")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    cmd = [exe]
    if "Open MPI" in version or "OpenRTE" in version:
        cmd += ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    return cmd


def run_mpi(n, script, *args, timeout=300, env=None):
    """Run ``python script args`` on n ranks; return the completed process (output captured)."""
    e = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
             PYTHONUNBUFFERED="1", **(env or {}))
    cmd = mpi_launcher() + ["-n", str(n), sys.executable, str(ROOT / script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e, cwd=ROOT)


def gpu_count():
    from moecomm.comm import gpu_count as count
    return count()
