"""Every example runs (host transport, several ranks)."""
import pytest

from conftest import run_mpi


@pytest.mark.parametrize("ranks", [2, 3])
def test_demo(ranks):
    p = run_mpi(ranks, "examples/demo.py", "--transport", "host", timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "all ranks match the numpy reference" in p.stdout


@pytest.mark.parametrize("example,framework", [("train_jax.py", "jax"), ("train_torch.py", "torch")])
def test_training_example(example, framework):
    """The loss falls over the example's steps and its first step's gradients match one device's."""
    pytest.importorskip(framework)
    p = run_mpi(2, f"examples/{example}", timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "the loss falls and the gradients match" in p.stdout, p.stdout[-3000:]
