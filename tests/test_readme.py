"""The README says what is true: its first program runs on 2 host ranks, and every line of its API at a glance
is the function's real signature (parameter names, order and defaults)."""
import ast
import inspect
import re

import pytest

from conftest import ROOT, TORCH_CPU, need, run_mpi

README = (ROOT / "README.md").read_text()


def _block(marker):
    """The fenced code block right after an HTML comment that starts with ``marker``."""
    m = re.search(rf"<!-- {marker}.*?-->\s*```python\n(.*?)```", README, re.S)
    assert m, f"README has no code block after <!-- {marker}"
    return m.group(1)


def test_the_first_program_runs(tmp_path):
    script = tmp_path / "first.py"
    script.write_text(_block("snippet"))
    p = run_mpi(2, str(script), timeout=120)
    assert p.returncode == 0 and p.stdout.count("combine matches") == 2, p.stdout[-3000:] + p.stderr[-3000:]


def _target(call):
    import moecomm
    from moecomm.alltoall import AllToAll
    from moecomm.comm import Communicator
    owner, _, name = call.rpartition(".")
    if owner == "moecomm.jax":
        return getattr(need("moecomm.jax", 'pip install ".[test]"'), name).__init__
    if owner == "moecomm.torch":
        need("torch", TORCH_CPU)
        import moecomm.torch
        return getattr(moecomm.torch, name).__init__
    if owner == "moecomm":
        target = getattr(moecomm, name)
        return target.__init__ if inspect.isclass(target) else target
    if owner == "layer":
        return getattr(need("moecomm.jax", 'pip install ".[test]"').AllToAll, name)
    if (owner, name) == ("", "call"):  # a prepared call, called
        from moecomm.alltoall import PreparedCall
        return PreparedCall.__call__
    return getattr({"a2a": AllToAll, "comm": Communicator}[owner], name)


LINES = [line for line in _block("api").splitlines() if line.strip()]


@pytest.mark.parametrize("line", LINES, ids=lambda s: s.split("(")[0].split("= ")[-1])
def test_api_line_is_the_signature(line):
    call = re.match(r"(?:\w+ = )?([\w.]+)\((.*)\)$", line)
    assert call, line
    params = [p for p in inspect.signature(_target(call.group(1))).parameters.values() if p.name != "self"]
    shown = [a.strip() for a in call.group(2).split(",") if a.strip()]
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    assert [s.split("=")[0] for s in shown] == [stars.get(p.kind, "") + p.name for p in params], line
    for s, p in zip(shown, params):
        if s.startswith("*"):
            continue
        if "=" in s:
            assert ast.literal_eval(s.split("=", 1)[1]) == p.default, (line, p.name)
        else:
            assert p.default is inspect.Parameter.empty, (line, p.name)


def test_the_api_lists_every_public_method_and_the_readme_stays_short():
    """Every public method of AllToAll has its line above; README stays <= 220 lines (the rest lives in docs/)."""
    from moecomm.alltoall import AllToAll
    listed = {re.match(r"(?:\w+ = )?([\w.]+)\(", line).group(1) for line in LINES}
    public = {n for n, v in vars(AllToAll).items() if not n.startswith("_") and callable(v)}
    assert not {n for n in public if f"a2a.{n}" not in listed}, "README's API at a glance lacks some"
    assert README.count("\n") <= 220
