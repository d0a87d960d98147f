"""The kernel build pipeline on a CPU-only machine: every kernel compiles and links for sm_90, the disk
cache is keyed, checked and safe under concurrency, and compile errors carry the log with file and line."""
import ctypes
import os
import subprocess
import sys

import pytest

import dataclasses
from pathlib import Path

from conftest import ROOT
from moecomm import _abi, _cache, _jit
from moecomm._errors import CompileError


def _cli(cache, *args):
    env = dict(os.environ, MOECOMM_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "moecomm.build", *args], capture_output=True, text=True,
                          env=env, timeout=600)


def test_cli_builds_every_kernel_then_hits_cache(tmp_path):
    first = _cli(tmp_path, "--arch", "sm_90")
    assert first.returncode == 0, first.stderr
    assert " built in " in first.stdout
    kernels = [line.split()[0] for line in first.stdout.splitlines()[2:]]
    sources = (ROOT / "cuda").glob("*.cu")
    declared = {w.split("(")[0] for f in sources for w in f.read_text().split()
                if w.startswith("moecomm_") and "(" in w}
    assert set(kernels) == declared == set(_abi.KERNELS), (kernels, declared)
    second = _cli(tmp_path, "--arch", "sm_90")
    assert "from cache" in second.stdout


def test_cli_refuses_a_bad_arch_in_one_line(tmp_path):
    p = _cli(tmp_path, "--arch", "foo")
    assert p.returncode == 2 and "'foo' is not a CUDA architecture" in p.stderr and "Traceback" not in p.stderr


def test_concurrent_builds_share_one_compile(tmp_path):

    env = dict(os.environ, MOECOMM_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "moecomm.build", "--arch", "sm_90"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) for _ in range(3)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(" built in " in o for o in outs) == 1, outs


def test_key_covers_abi_and_sources_not_paths(monkeypatch, tmp_path):
    base = _jit.build_key("sm_90")
    assert _jit.build_key("sm_90a") != base
    monkeypatch.setattr(_abi, "header", lambda: "#define MOECOMM_ERR_TIMEOUT 99\n")
    assert _jit.build_key("sm_90") != base
    monkeypatch.undo()
    elsewhere = dataclasses.replace(_jit.Toolchain.find(), nvshmem_include=Path("/elsewhere/include"),
                                    nvshmem_device_lib=Path("/elsewhere/lib/libnvshmem_device.a"),
                                    cuda_include=Path("/elsewhere/cuda/include"))
    assert _jit.build_key("sm_90", elsewhere) == base  # another environment with the same versions
    src = tmp_path / "src"
    src.mkdir()
    for f in (ROOT / "cuda").iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    assert _jit.build_key("sm_90", src=src) == base
    (src / "transport.cuh").write_text((src / "transport.cuh").read_text() + "\n// changed\n")
    assert _jit.build_key("sm_90", src=src) != base


def test_damaged_entry_is_rebuilt(tmp_path):
    calls = []
    build = lambda: calls.append(1) or b"payload"
    assert _cache.get_or_build("k", build, tmp_path) == (b"payload", False)
    assert _cache.get_or_build("k", build, tmp_path) == (b"payload", True)
    entry = tmp_path / "k.bin"
    entry.write_bytes(entry.read_bytes()[:-1] + b"X")
    assert _cache.get_or_build("k", build, tmp_path) == (b"payload", False)
    assert len(calls) == 2


def test_compile_error_has_file_and_line(tmp_path):
    bad = tmp_path / "broken.cu"
    bad.write_text('#include "transport.cuh"\n\nextern "C" __global__ void k() { undeclared_name(); }\n')
    tc = _jit.Toolchain.find()
    with pytest.raises(CompileError) as e:
        _jit._nvrtc_compile(bad, _jit._nvrtc_options(tc, ROOT / "cuda", "sm_90"), tc.rtc_headers())
    assert "broken.cu(3)" in str(e.value) and "undeclared_name" in str(e.value)


def test_resource_parser():
    log = ("ptxas info    : Function properties for kern\n"
           "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
           "info    : Function properties for 'kern':\n"
           "info    : used 40 registers, used 1 barriers, 16 stack, 2048 bytes smem, 564 bytes cmem[0]\n")
    assert _jit.parse_resources(log) == {"kern": dict(registers=40, stack=16, smem=2048, spill_stores=4,
                                                      spill_loads=12)}


def test_kernel_signature_must_match_the_abi_table(tmp_path):
    """A kernel whose parameters differ from its declaration in moecomm_abi.h does not build."""
    bad = tmp_path / "delay.cu"
    bad.write_text('#include "transport.cuh"\nextern "C" __global__ void moecomm_delay(unsigned long long ns) {}\n')
    tc = _jit.Toolchain.find()
    with pytest.raises(CompileError, match="moecomm_delay"):
        _jit._nvrtc_compile(bad, _jit._nvrtc_options(tc, ROOT / "cuda", "sm_90"), tc.rtc_headers())


def test_abi_header_states_every_struct_field():
    text = _abi.header()
    for struct in _abi.STRUCTS:
        assert f"static_assert(sizeof({struct.__name__}) == {ctypes.sizeof(struct)}" in text
        for field, _ in struct.c_fields:
            assert f"decltype({struct.__name__}::{field})" in text
    for name, k in _abi.KERNELS.items():
        assert f'extern "C" __global__ void {name}(' in text
