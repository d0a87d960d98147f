"""An installed moecomm carries its CUDA sources (a wheel install must find them)."""
import importlib.metadata
import json
from pathlib import Path

import pytest

import moecomm
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
