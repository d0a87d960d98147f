"""Every example runs (host transport, several ranks) or says what it needs; every tool's and command's
--help describes it in whole sentences, and every option says what it does."""
import os
import runpy
import subprocess
import sys

import pytest

from conftest import FULL, NEEDS_GPU, ROOT, TORCH_CPU, need, run_mpi


@pytest.mark.parametrize("ranks", [2, 3])
def test_demo(ranks):
    p = run_mpi(ranks, "examples/demo.py", "--transport", "host", timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "all ranks match the numpy reference" in p.stdout


@pytest.mark.parametrize("example,framework,install", [("train_jax.py", "jax", 'pip install ".[test]"'),
                                                       ("train_torch.py", "torch", TORCH_CPU)])
def test_training_example(example, framework, install):
    """The loss falls over the example's steps and its first step's gradients match one device's."""
    need(framework, install)
    p = run_mpi(2, f"examples/{example}", timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "the loss falls and the gradients match" in p.stdout, p.stdout[-3000:]


@FULL
def test_jax_example_on_cpu_ranks():
    """examples/jax_moe.py (the layer in shard_map across the ranks' processes, whole and split calls) runs on the
    host transport without a GPU."""
    p = run_mpi(2, "examples/jax_moe.py", "--tokens", "32", "--hidden", "256", "--steps", "2", timeout=300)
    assert p.returncode == 0 and "all ranks match" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]


def test_gpu_only_example_says_what_it_needs():
    """examples/torch_moe.py captures a torch CUDA graph: without CUDA it prints one line naming its need and
    exits non-zero."""
    torch = need("torch", TORCH_CPU)
    if torch.cuda.is_available():
        pytest.skip(f"this machine has CUDA (this checks the example's message without it); {NEEDS_GPU}")
    p = subprocess.run([sys.executable, str(ROOT / "examples/torch_moe.py")], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    lines = (p.stdout + p.stderr).strip().splitlines()
    assert p.returncode != 0 and len(lines) == 1 and "needs an NVIDIA GPU" in lines[0], lines


def _description(help_text):
    """The paragraph argparse prints after the usage lines."""
    return help_text.split("\n\n")[1]


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "tools").glob("*.py")))
def test_tool_help_is_whole(script, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "tools" / script), run_name="__main__")
    text = capsys.readouterr().out
    assert e.value.code == 0 and _description(text).rstrip().endswith("."), text


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # run again in this process
@pytest.mark.parametrize("module", ["bench", "build", "loadtest", "balance", "telemetry", "reference"])
def test_module_help_is_whole_or_says_it_is_no_command(module, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module(f"moecomm.{module}", run_name="__main__")
    if e.value.code == 0:
        assert _description(capsys.readouterr().out).rstrip().endswith(".")
    else:
        assert str(e.value.code).startswith(f"moecomm.{module} is a library module, not a command")


class _Parsed(Exception):
    """Raised in place of parsing: carries the program's ArgumentParser."""


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # run again in this process
@pytest.mark.parametrize("program", [f"{d}/{p.name}" for d in ("tools", "examples")
                                     for p in sorted((ROOT / d).glob("*.py"))] + ["moecomm.bench", "moecomm.loadtest"])
def test_every_option_is_described(program, monkeypatch):
    """Every option of every tool, example and command module says what it does (argparse help; its allowed
    values are argparse choices where there are some): the parser is taken where the program parses."""
    import argparse

    def grab(self, *args, **kwargs):
        raise _Parsed(self)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", grab)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", grab)
    monkeypatch.setattr(sys, "argv", [program])
    try:
        if program.startswith("moecomm."):
            runpy.run_module(program, run_name="__main__")
        else:
            runpy.run_path(str(ROOT / program), run_name="__main__")
    except _Parsed as parsed:
        actions = [a for a in parsed.args[0]._actions if not isinstance(a, argparse._HelpAction)]
    except ImportError as e:
        pytest.skip(f"{program} needs {e.name}")
    else:
        pytest.fail(f"{program} parsed no arguments")
    assert not [a.option_strings or a.dest for a in actions if not (a.help or "").strip()]
