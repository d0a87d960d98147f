"""The kernel build pipeline on a CPU-only machine: every variant's kernels compile and link for sm_90 (the
nvshmem and ipc transports, the benchmark's module), the disk cache is keyed, checked and safe under
concurrency, and compile errors carry the log with file and line."""
import ctypes
import os
import re
import subprocess
import sys

import pytest

import dataclasses
from pathlib import Path

from conftest import FULL, ROOT
from moecomm import _abi, _cache, _jit
from moecomm._errors import CompileError
from moecomm.transport import gpu_plan


def _cli(cache, *args):
    env = dict(os.environ, MOECOMM_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "moecomm.build", *args], capture_output=True, text=True,
                          env=env, timeout=600)


def _variant_kernels(stdout):
    """{variant: [kernel, ...]} from the CLI's report (a C++ kernel by its C++ name)."""
    out, current = {}, None
    for line in stdout.splitlines():
        if not line.startswith(" "):
            current = line.split(":")[0]
            out[current] = []
        elif line.split()[0].startswith("moecomm"):
            out[current].append(line.split()[0])
    return out


def _reported(names):
    """The names the CLI reports for these moecomm._abi.KERNELS entries (several may launch one C++ kernel)."""
    return {_abi.KERNELS[n].cxx or n for n in names}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One build of every variant into a fresh cache, shared by the tests below: (cache dir, CLI result)."""
    cache = tmp_path_factory.mktemp("cache")
    return cache, _cli(cache, "--arch", "sm_90")


def test_cli_builds_every_variant_then_hits_cache(built):
    cache, first = built
    assert first.returncode == 0, first.stderr
    assert first.stdout.count(" built in ") == len(_jit.VARIANTS)
    kernels = _variant_kernels(first.stdout)
    alltoall = set(gpu_plan.GRIDS) | {"moecomm_peer_check"}
    assert set(kernels["nvshmem"]) == set(kernels["ipc"]) == _reported(alltoall), kernels
    assert kernels["bench"] == ["moecomm_delay"]  # the benchmark's kernel is in no transport's module
    sources = " ".join(f.read_text() for f in (ROOT / "cuda").glob("*.cu"))
    declared = {w.split("(")[0] for w in sources.split() if w.startswith("moecomm_") and "(" in w}
    declared |= {k.cxx for k in _abi.KERNELS.values()  # C++ kernels: their namespace and name
                 if k.cxx and f"namespace {k.cxx.rsplit('::', 1)[0]}" in sources and f" {k.cxx.split('::')[-1]}("
                 in sources}
    assert _reported(alltoall | {"moecomm_delay"}) == declared == _reported(_abi.KERNELS), declared
    second = _cli(cache, "--arch", "sm_90")
    assert second.stdout.count("from cache") == len(_jit.VARIANTS)


def test_every_launch_plan_names_kernels_its_module_has(built):
    """Every (layout, combine wire, world size 1/2/8, batch size, SM budget, gradients) plans kernels that its
    module was built with, each with a grid of at most BLOCKS_PER_SM per budgeted SM; a phase in one launch is
    one kernel (plus the packed layout's pack), resident at once; the halves are the four halves' kernels."""
    from moecomm import _constants as C
    from moecomm._config import AllToAllConfig
    kernels = {v: set(k) for v, k in _variant_kernels(built[1].stdout).items()}
    plans = 0
    for layout in ("padded", "packed"):
        for wire in (None, "e4m3", "e4m3_ue8m0"):
            for world in (1, 2, 8):
                for tokens in (1, 128, 4096):
                    for max_sms in (None, 44, 4):
                        for grads in (False, True):
                            c = AllToAllConfig.create(world, 0, tokens, 32 * world, 8, 7168, 56, "float8_e4m3fn",
                                                      "bfloat16", None, 1, layout=layout, combine_wire=wire,
                                                      max_sms=max_sms, gradients=grads)
                            for variant, mapped in (("ipc", True), ("nvshmem", True), ("nvshmem", False)):
                                p = gpu_plan.launch_plan(c, 132, variant, mapped)
                                named = {*p.backward.values(), *(k for ks in p.halves.values() for k in ks),
                                         *(k for ks in p.whole.values() for k in ks),
                                         *([gpu_plan.SOURCE_LAYOUT] if c.slots_by_source else [])}
                                assert _reported(named) <= kernels[p.variant], (c, p)
                                assert named == set(p.grids), p  # every launch has its grid
                                assert all(0 < g <= C.BLOCKS_PER_SM * p.sms for g in p.grids.values()), p
                                assert [k[0] for k in p.halves.values()] == list(gpu_plan.half_kernels(c))
                                for phase, ks in p.whole.items():
                                    assert gpu_plan.resident(p.grids[ks[0]], 132) and not p.fallback
                                    assert len(ks) == 1
                                assert bool(p.backward) == grads
                                if grads:  # the local path's backward where its forward takes it
                                    assert (p.backward["combine_backward"].endswith("_local")
                                            == (world == 1 and layout == "padded")), p
                                plans += 1
    assert plans == 2 * 3 * 3 * 3 * 3 * 2 * 3


def test_a_phase_whose_grid_is_not_resident_runs_its_halves_and_the_plan_says_why():
    """More ranks than BLOCKS_PER_SM * SMs: the one-launch grid (a block per source rank at least) cannot be
    resident at once, so the phase runs its halves' kernels, and the plan names the reason."""
    from moecomm._config import AllToAllConfig
    c = AllToAllConfig.create(16, 0, 128, 64, 8, 1024, None, "bfloat16", "bfloat16", None, 1)
    p = gpu_plan.launch_plan(c, 4, "ipc")  # 8 blocks resident on 4 SMs, 16 sources
    assert p.whole == {"dispatch": ("moecomm_dispatch_send", "moecomm_dispatch_recv"),
                       "combine": ("moecomm_combine_send", "moecomm_combine_recv")}
    assert set(p.fallback) == {"dispatch", "combine"} and "not resident" in p.fallback["dispatch"]
    assert p.summary()["fallback"] == p.fallback


def test_ipc_module_has_no_nvshmem(built, monkeypatch):
    monkeypatch.setenv("MOECOMM_CACHE_DIR", str(built[0]))
    cubin = _jit.build("sm_90", "ipc").cubin
    assert b"moecomm_dispatch_send" in cubin and b"nvshmem" not in cubin.lower()
    assert b"nvshmem" in _jit.build("sm_90", "nvshmem").cubin.lower()


@pytest.mark.parametrize("arch", ["foo", "sm_42"])
def test_cli_refuses_a_bad_arch_in_one_line(tmp_path, arch):
    """A malformed name, and a well-formed one NVRTC does not build for, are usage errors, not NVRTC's."""
    p = _cli(tmp_path, "--arch", arch)
    assert p.returncode == 2 and f"'{arch}' is not a CUDA architecture" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and "nvrtc: error" not in p.stderr


@FULL
def test_concurrent_builds_share_one_compile(tmp_path):

    env = dict(os.environ, MOECOMM_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "moecomm.build", "--arch", "sm_90", "--variants", "ipc,bench"]  # the quick ones
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) for _ in range(3)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(o.count(" built in ") for o in outs) == 2, outs  # each variant built by one process


def test_key_covers_abi_and_sources_not_paths(monkeypatch, tmp_path):
    base = _jit.build_key("sm_90")
    assert _jit.build_key("sm_90a") != base
    monkeypatch.setattr(_abi, "header", lambda: "#define MOECOMM_ERR_TIMEOUT 99\n")
    assert _jit.build_key("sm_90") != base
    monkeypatch.undo()
    elsewhere = dataclasses.replace(_jit.Toolchain.find(), nvshmem_include=Path("/elsewhere/include"),
                                    nvshmem_device_lib=Path("/elsewhere/lib/libnvshmem_device.a"),
                                    cuda_include=Path("/elsewhere/cuda/include"))
    assert _jit.build_key("sm_90", toolchain=elsewhere) == base  # another environment, the same versions
    assert _jit.build_key("sm_90", "ipc") != base
    newer = dataclasses.replace(_jit.Toolchain.find(), versions=dict(elsewhere.versions, nvshmem="9.9.9"))
    assert _jit.build_key("sm_90", toolchain=newer) != base
    assert _jit.build_key("sm_90", "ipc", toolchain=newer) == _jit.build_key("sm_90", "ipc")  # no NVSHMEM in it
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
        _jit._nvrtc_compile(bad, _jit._nvrtc_options(tc, ROOT / "cuda", "sm_90", "nvshmem"), tc.rtc_headers())
    assert "broken.cu(3)" in str(e.value) and "undeclared_name" in str(e.value)


def test_resource_parser():
    log = ("ptxas info    : Function properties for kern\n"
           "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
           "info    : Function properties for 'kern':\n"
           "info    : used 40 registers, used 1 barriers, 16 stack, 2048 bytes smem, 564 bytes cmem[0]\n")
    assert _jit.parse_resources(log) == {"kern": dict(registers=40, stack=16, smem=2048, spill_stores=4,
                                                      spill_loads=12)}
    # ptxas's own lines (no per-function summary), with and without a stack: the shared memory is read either way
    log = ("ptxas info    : Compiling entry function 'a' for 'sm_90'\n"
           "ptxas info    : Function properties for a\n"
           "ptxas         .     64 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 97 registers, used 1 barriers, 64 bytes cumulative stack size, 23052 bytes smem\n"
           "ptxas info    : Compiling entry function 'b' for 'sm_90'\n"
           "ptxas info    : Used 60 registers, used 1 barriers, 265 bytes smem\n")
    assert _jit.parse_resources(log) == {
        "a": dict(registers=97, stack=64, smem=23052, spill_stores=0, spill_loads=0),
        "b": dict(registers=60, stack=0, smem=265, spill_stores=0, spill_loads=0)}


def test_kernel_signature_must_match_the_abi_table(tmp_path):
    """A kernel whose parameters differ from its declaration in moecomm_abi.h does not build."""
    bad = tmp_path / "delay.cu"
    bad.write_text('#include "transport.cuh"\nextern "C" __global__ void moecomm_delay(unsigned long long ns) {}\n')
    tc = _jit.Toolchain.find()
    with pytest.raises(CompileError, match="moecomm_delay"):
        _jit._nvrtc_compile(bad, _jit._nvrtc_options(tc, ROOT / "cuda", "sm_90", "nvshmem"), tc.rtc_headers())


def test_abi_header_states_every_struct_field():
    text = _abi.header()
    for struct in _abi.STRUCTS:
        assert f"static_assert(sizeof({struct.__name__}) == {ctypes.sizeof(struct)}" in text
        for field, _ in struct.c_fields:
            assert f"decltype({struct.__name__}::{field})" in text
    for name, k in _abi.KERNELS.items():  # extern "C", or a C++ kernel in its namespace
        space, _, cxx = k.cxx.rpartition("::")
        declared = f"namespace {space} {{ __global__ void {cxx}(" if k.cxx else f'extern "C" __global__ void {name}('
        assert declared in text


def test_the_call_record_fits_128_bytes():
    """Every launch copies the Call record as a kernel parameter: at 136 bytes the default path was ~0.3 us
    slower (benchmarks/NOTES.md), so new flags are bytes within the 128."""
    assert ctypes.sizeof(_abi.Call) <= 128


def test_the_bound_m_rule_is_the_same_in_the_kernels_and_on_the_host():
    """cuda/alltoall.cuh's m_in_range, evaluated as Python, agrees with moecomm.reference.m_in_range everywhere
    around the edges; no kernel spells the rule again."""
    from moecomm import reference
    text = (ROOT / "cuda" / "alltoall.cuh").read_text()
    body = re.search(r"bool m_in_range\(int m, int rows, int max_tokens\) \{\s*return ([^;]*);", text).group(1)
    expr = body.replace("&&", " and ").replace("||", " or ").replace("!", " not ")
    for m in range(-2, 12):
        for rows in range(0, 10):
            for max_tokens in range(0, 10):
                here = dict(m=m, rows=rows, max_tokens=max_tokens)
                assert eval(expr, {}, here) == reference.m_in_range(**here), (body, here)
    for f in (ROOT / "cuda").glob("*.cu*"):
        assert not re.search(r"\bm (>|<) (c|g)\.rows|\bm < 0\b", f.read_text()), f.name


def test_dependent_kernels_wait_for_the_kernel_before_them_first():
    """A kernel launched as a programmatic dependent (Kernel.dependent) may start while the stream's previous
    kernel runs: its body must begin with the wait for it; the others must not be dependent."""
    bodies = {}
    for f in (ROOT / "cuda").glob("*.cu"):
        for m in re.finditer(r'extern "C" __global__ void[^{]*?(moecomm_\w+)\([^)]*\) \{\s*([^;]*;)', f.read_text()):
            bodies[m.group(1)] = m.group(2)
        space = re.search(r"^namespace ([\w:]+) \{", f.read_text(), re.M)  # C++ kernels: by namespace::name
        for m in re.finditer(r"^__global__ void[^{]*?(\w+)\([^)]*\) \{\s*([^;]*;)", f.read_text(), re.M):
            bodies[f"{space[1]}::{m.group(1)}"] = m.group(2)
    assert set(bodies) == _reported(_abi.KERNELS)
    for name, k in _abi.KERNELS.items():
        body = bodies[k.cxx or name]
        assert (body == "after_previous_kernel();") == k.dependent, (name, body)
    assert {n for n, k in _abi.KERNELS.items() if not k.dependent} == {"moecomm_delay", "moecomm_peer_check"}


def test_gpu_check_says_what_it_does_and_needs():
    """tools/gpu_check.sh --help prints its modes without running anything; without a GPU it says so."""
    import subprocess
    p = subprocess.run(["bash", "tools/gpu_check.sh", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert p.returncode == 0 and "ranks" in p.stdout and "===" not in p.stdout, p.stdout + p.stderr
    if subprocess.run(["bash", "-c", "nvidia-smi -L"], capture_output=True).returncode != 0:
        p = subprocess.run(["bash", "tools/gpu_check.sh", "quick"], capture_output=True, text=True, cwd=ROOT,
                           timeout=30)
        assert p.returncode == 2 and "no GPU visible" in p.stderr, p.stdout + p.stderr


def test_gpu_check_selections_name_tests_of_the_gpu_suite():
    """Each `suite "EXPR"` of tools/gpu_check.sh (its modes' test programs, run as `pytest tests/test_gpu.py -k
    EXPR`) selects tests of tests/test_gpu.py, and every name it combines matches one: a renamed test or a typo
    would otherwise leave a mode silently running less."""
    from _pytest.mark.expression import Expression
    text = (ROOT / "tools" / "gpu_check.sh").read_text().replace("\\\n", "")
    text = re.sub(r'\$\(\[ "\$\{1:-\}" = bench \] &&\s*echo " or (\w+)"\)', r" or \1", text)  # the bench mode's extra
    exprs = re.findall(r'(?m)^\s*(?:\[[^]]*\] \|\| \{ \[ \$status = 0 \] && )?suite "([^"]+)"', text)
    assert len(exprs) >= 15, exprs
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "tests/test_gpu.py"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    ids = [line.lower() for line in p.stdout.splitlines() if "::" in line]
    assert ids, p.stdout + p.stderr
    for expr in exprs:
        assert any(Expression.compile(expr).evaluate(lambda name, i=i: name.lower() in i) for i in ids), expr
        for name in set(re.findall(r"[\w-]+", expr)) - {"and", "or", "not"}:
            assert any(name.lower() in i for i in ids), (expr, name)


def test_deep_ep_names_run_the_halves_with_the_same_grids(built):
    """kernel_names="deep_ep": each half runs the C++ kernel of its phase (moecomm::deep_ep::dispatch /
    combine, one name per phase as DeepEP's profiler-based timing wants) with its own half's grid; on an FP8
    combine wire the combine keeps its own kernels; the whole phases are unchanged; the module has them."""
    from moecomm._config import AllToAllConfig
    kernels = {v: set(k) for v, k in _variant_kernels(built[1].stdout).items()}
    for wire in (None, "e4m3"):
        for world in (1, 2):
            args = (world, 0, 128, 32 * world, 8, 7168, 56, "float8_e4m3fn", "bfloat16", None, 1)
            ours, theirs = (gpu_plan.launch_plan(AllToAllConfig.create(*args, combine_wire=wire, kernel_names=n),
                                                 132, "ipc") for n in ("moecomm", "deep_ep"))
            assert theirs.whole == ours.whole
            for half, (mine,) in ours.halves.items():
                (name,) = theirs.halves[half]
                renamed = wire is None or half.startswith("dispatch")
                assert name == (f"moecomm_deep_ep_{half}" if renamed else mine)
                assert theirs.grids[name] == ours.grids[mine]
                assert _abi.KERNELS[name].cxx == (f"moecomm::deep_ep::{half.split('_')[0]}" if renamed else "")
            assert _reported(theirs.grids) <= kernels["ipc"]
