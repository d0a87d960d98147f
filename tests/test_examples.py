"""Every example runs (host transport, several ranks)."""
import pytest

from conftest import run_mpi


@pytest.mark.parametrize("ranks", [2, 3])
def test_demo(ranks):
    p = run_mpi(ranks, "examples/demo.py", "--transport", "host", timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "all ranks match the numpy reference" in p.stdout
