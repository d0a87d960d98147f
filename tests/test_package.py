"""An installed moecomm carries its CUDA sources (a wheel install must find them), and docs/design.md's map of
the files is whole."""
import importlib.metadata
import json
import re
from pathlib import Path

import pytest

import moecomm
from conftest import ROOT
from moecomm import _jit


def test_installed_wheel_has_cuda_sources():
    installed = [d for d in importlib.metadata.distributions(name="moecomm") if d.read_text("RECORD")]
    if not installed:
        pytest.skip("moecomm is not installed (running from a checkout): pip install . (not -e), then run it")
    direct = json.loads(installed[0].read_text("direct_url.json") or "{}")
    if direct.get("dir_info", {}).get("editable"):
        pytest.skip("an editable install runs the checkout's sources: pip install . (not -e) checks the wheel")
    files = {str(f) for f in installed[0].files}
    repo = {f"moecomm/cuda/{p.name}" for p in (Path(__file__).parent.parent / "cuda").iterdir()}
    assert repo <= files, repo - files


def test_sources_found():
    assert (_jit.source_dir() / "transport.cuh").is_file()
    assert moecomm.__version__


def test_the_design_map_names_every_file():
    """docs/design.md's tables of layers and kernels name every file of moecomm/, moecomm/transport/ and cuda/."""
    text = (ROOT / "docs" / "design.md").read_text()
    layers = text.split("## Layers")[1].split("\n## ")[0]
    kernels = text.split("## Kernels")[1].split("\n**")[0]
    named = set(re.findall(r"`(?:moecomm/(?:transport/)?)?([\w.]+)`", layers))
    missing = [f"moecomm/{f.name}" for f in (ROOT / "moecomm").glob("*.py") if f.name not in named | {"__init__.py"}]
    missing += [f"moecomm/transport/{f.name}" for f in (ROOT / "moecomm" / "transport").glob("*.py")
                if f.name not in named]
    cuda_named = set(re.findall(r"`([\w.]+)`", kernels))
    missing += [f"cuda/{f.name}" for f in (ROOT / "cuda").iterdir() if f.name not in cuda_named]
    assert not missing, missing
