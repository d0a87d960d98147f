"""Build the CUDA sources in ``cuda/`` into cubins with NVRTC and nvJitLink, one per module variant.

Variants (:data:`VARIANTS`): ``nvshmem`` and ``ipc`` hold the same dispatch/combine and peer-check kernels
over two device transports (``cuda/transport_nvshmem.cuh``, ``cuda/transport_ipc.cuh``, chosen by a
define); ``bench`` holds the benchmark's delay kernel alone, so it is never part of a transport's module.

Compile path (chosen on purpose): every ``.cu`` file of a variant is compiled by NVRTC to LTO-IR with
relocatable device code (``-rdc=true -dlto``) and linked by nvJitLink; the ``nvshmem`` variant links
NVSHMEM's static device library ``libnvshmem_device.a``. Linking the real device library, rather than NVSHMEM's
header-only mode, keeps the IBGDA (GPU-initiated InfiniBand) and proxy code paths in the kernels, so a peer
reachable only over the network goes through the same kernels as an NVLink peer. The header-only mode has no IBGDA code.

Three header fixes are needed for NVSHMEM 3.4 under NVRTC:

* NVSHMEM's device library was built with LP64 ``uint64_t`` = ``unsigned long``; NVRTC's CCCL
  ``<cuda/std/cstdint>`` says ``unsigned long long``, so mangled names would not match at link time. We
  hand NVRTC an in-memory copy of that header with the 64-bit typedefs as ``long`` / ``unsigned long``.
* ``nvshmem_defines.h`` includes ``cuda_runtime.h``, which is host code; NVRTC gets an empty one.
* ``nvshmem_tensor.h`` has an unannotated constructor: ``-default-device``; ``reduce.cuh`` uses
  ``std::is_integral`` and friends without including them: ``cuda/nvshmem_rtc.cuh`` maps them.

CCCL headers come from CuPy's bundled copy (a dependency on every machine), CUDA headers
(``cuda_fp16.h``...) from the ``nvidia-cuda-runtime`` wheel or the toolkit.
"""
import concurrent.futures
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from . import _abi, _cache
from ._errors import CompileError

FORMAT = "moecomm-build-v3"  # bump when the payload layout or the build recipe changes


@dataclass(frozen=True)
class Variant:
    """One module: its ``.cu`` files; ``header``, the device
    transport header it is built against (``cuda/transport_<name>.cuh``, included by ``cuda/transport.cuh``
    as MOECOMM_TRANSPORT_HEADER), or "" for a module without one; ``puts``, whether that transport reaches peers
    by puts (MOECOMM_HAS_PUTS: peers on other nodes); ``nvshmem``, whether NVSHMEM's headers and device library
    are part of it; ``streams_combine``, whether its one-launch combine carries the streamed form
    (``MOECOMM_STREAMS_COMBINE``; used where moecomm.transport.gpu_plan.combine_streams says so; where it does
    not, that code is compiled out: present but switched off at run time, it cost the nvshmem build's
    one-launch combine 15 us at R1-prefill). Which variant's kernels an AllToAll runs:
    moecomm/transport/gpu_plan.py; the transports' classes: moecomm.transport.GPU_TRANSPORTS."""
    sources: tuple
    header: str = ""
    puts: bool = False
    nvshmem: bool = False
    streams_combine: bool = False


_KERNELS = ("dispatch_send.cu", "dispatch_recv.cu", "dispatch.cu", "combine_send.cu",
            "combine_recv.cu", "combine.cu", "local.cu", "backward.cu", "deep_ep.cu", "peer_check.cu", "trace.cu")
VARIANTS = {
    "nvshmem": Variant(_KERNELS, "transport_nvshmem.cuh", puts=True, nvshmem=True),
    "ipc": Variant(_KERNELS, "transport_ipc.cuh", streams_combine=True),
    "bench": Variant(("delay.cu",)),
}


def source_dir():
    """The folder holding the CUDA sources: ``moecomm/cuda`` in an installed wheel, ``cuda/`` in a checkout."""
    here = Path(__file__).resolve().parent
    for d in (here / "cuda", here.parent / "cuda"):
        if (d / "transport.cuh").is_file():
            return d
    raise CompileError(f"CUDA sources not found beside {here} (looked for cuda/transport.cuh)")


def _package_dir(name):
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _dist_version(module):
    for dist in importlib.metadata.packages_distributions().get(module, []):
        return f"{dist}=={importlib.metadata.version(dist)}"
    return "unknown"


@dataclass(frozen=True)
class Toolchain:
    """Where the headers and the NVSHMEM device library are (None when the NVSHMEM wheel is missing: only
    the variants without NVSHMEM build then), and the versions that go into the cache key."""
    nvshmem_include: object
    nvshmem_device_lib: object
    cccl_include: Path
    cuda_include: Path
    versions: dict

    @classmethod
    def find(cls):
        from cuda.bindings import nvjitlink, nvrtc
        spec = importlib.util.find_spec("nvidia")  # namespace of the NVIDIA wheels
        wheels = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
        nvshmem = Path(os.environ.get("MOECOMM_NVSHMEM_HOME")
                       or next((w / "nvshmem" for w in wheels if (w / "nvshmem").is_dir()), "nvshmem-not-found"))
        cupy = _package_dir("cupy")
        cccl = cupy / "_core" / "include" / "cupy" / "_cccl" / "libcudacxx" if cupy else None
        cuda_candidates = [w / "cu13" / "include" for w in wheels]
        cuda_candidates += [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"]
        cuda_inc = next((p for p in cuda_candidates if (p / "cuda_fp16.h").is_file()), None)
        missing = [what for what, p in (
            ("CCCL headers (cupy)", cccl / "cuda" / "std" / "cstdint" if cccl else None),
            ("CUDA headers (nvidia-cuda-runtime)", cuda_inc / "cuda_fp16.h" if cuda_inc else None),
        ) if p is None or not p.is_file()]
        if missing:
            raise CompileError("cannot build kernels, missing: " + "; ".join(missing))
        _, major, minor = nvrtc.nvrtcVersion()
        versions = {
            "nvrtc": f"{major}.{minor}",
            "nvjitlink": ".".join(map(str, nvjitlink.version())),
            "cccl": _dist_version("cupy"),
            "cuda_headers": _header_defines(cuda_inc / "cuda.h").get("CUDA_VERSION", "unknown"),
        }
        lib = nvshmem / "lib" / "libnvshmem_device.a"
        if not ((nvshmem / "include" / "nvshmem.h").is_file() and lib.is_file()):
            return cls(None, None, cccl, cuda_inc, versions)
        ver = _header_defines(nvshmem / "include" / "non_abi" / "nvshmem_version.h")
        versions["nvshmem"] = "{}.{}.{}".format(ver["NVSHMEM_VENDOR_MAJOR_VERSION"],
                                                ver["NVSHMEM_VENDOR_MINOR_VERSION"],
                                                ver["NVSHMEM_VENDOR_PATCH_VERSION"])
        versions["nvshmem_device_lib_sha256"] = _file_digest(lib)
        return cls(nvshmem / "include", lib, cccl, cuda_inc, versions)

    def for_variant(self, name):
        """The versions that matter to variant ``name``; raises CompileError when it needs NVSHMEM and the
        NVSHMEM wheel is missing."""
        if not VARIANTS[name].nvshmem:
            return {k: v for k, v in self.versions.items() if not k.startswith("nvshmem")}
        if self.nvshmem_include is None:
            raise CompileError(f"cannot build the {name} kernels, missing: NVSHMEM headers and device library "
                               f"(nvidia-nvshmem-cu13)")
        return self.versions

    def rtc_headers(self):
        """In-memory headers that NVRTC sees before any include path: (name, contents) pairs."""
        cstdint = (self.cccl_include / "cuda" / "std" / "cstdint").read_text()
        patched, n = re.subn(r"^using (u?int64_t)\s*=\s*(signed|unsigned) long long;",
                             r"using \1 = \2 long;", cstdint, flags=re.M)
        if n != 2:
            raise CompileError("CCCL <cuda/std/cstdint> changed layout: cannot apply the LP64 fix")
        return [("cuda/std/cstdint", patched),
                ("cuda_runtime.h", "#pragma once  // host header: not needed under NVRTC\n"),
                (_abi.HEADER_NAME, _abi.header())]


_digests = {}


def _file_digest(path):
    """SHA-256 of a file's contents (memoized per process by path, size and modification time)."""
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _digests:
        _digests[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return _digests[key]


def _header_defines(path):
    return dict(re.findall(r"^#define\s+(\w+)\s+(\d+)", Path(path).read_text(), flags=re.M))


@dataclass(frozen=True)
class Build:
    """A linked cubin for one arch and variant, and the resource use of each kernel in it.

    ``resources`` maps kernel name -> {registers, stack, smem, spill_stores, spill_loads} (bytes).
    """
    arch: str
    variant: str
    cubin: bytes
    resources: dict
    key: str
    cached: bool


def _compile_flags(arch, variant):
    cc = arch.split("_")[1]
    return ([f"-arch=compute_{cc}", "-rdc=true", "-dlto", "-std=c++17", "-default-device", "-lineinfo"]
            + _defines(VARIANTS[variant]))


def _defines(v):
    """The -D options of a variant (the build-cache key covers them)."""
    header = [f'-DMOECOMM_TRANSPORT_HEADER="{v.header}"'] if v.header else []
    return header + [f"-DMOECOMM_HAS_PUTS={int(v.puts)}", f"-DMOECOMM_STREAMS_COMBINE={int(v.streams_combine)}"]


def _nvrtc_options(toolchain, src, arch, variant):
    includes = [src] + ([toolchain.nvshmem_include] if VARIANTS[variant].nvshmem else [])
    return _compile_flags(arch, variant) + [f"-I{p}" for p in includes + [toolchain.cccl_include,
                                                                          toolchain.cuda_include]]


def supported_archs():
    """The ``sm_XY`` targets this NVRTC builds for (its own list)."""
    from cuda.bindings import nvrtc
    err, archs = nvrtc.nvrtcGetSupportedArchs()
    _check_nvrtc(err, "nvrtcGetSupportedArchs")
    return [f"sm_{a}" for a in archs]


def build_key(arch, variant="nvshmem", toolchain=None, src=None):
    """The cache key of one variant: every input that changes its cubin, by version and content (no paths),
    so two environments with the same toolchain versions share cache entries."""
    toolchain = toolchain or Toolchain.find()
    src = Path(src or source_dir())
    h = hashlib.sha256(FORMAT.encode())
    h.update(json.dumps([arch, variant, toolchain.for_variant(variant), _compile_flags(arch, variant)],
                        sort_keys=True).encode())
    for name, text in toolchain.rtc_headers():
        h.update(name.encode() + b"\0" + text.encode())
    for f in sorted(src.iterdir()):
        if f.suffix == ".cuh" or f.name in VARIANTS[variant].sources:
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:32]


def _nvrtc_compile(path, options, headers):
    from cuda.bindings import nvrtc
    names = [n.encode() for n, _ in headers]
    texts = [t.encode() for _, t in headers]
    err, prog = nvrtc.nvrtcCreateProgram(path.read_bytes(), str(path).encode(), len(texts), texts, names)
    _check_nvrtc(err, "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in options]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = bytearray(size)  # a fresh buffer: nvrtcGetProgramLog writes into it
        nvrtc.nvrtcGetProgramLog(prog, log)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"NVRTC failed on {path.name}:\n{log.decode(errors='replace').rstrip(chr(0))}")
        _, size = nvrtc.nvrtcGetLTOIRSize(prog)
        ltoir = bytearray(size)
        _check_nvrtc(nvrtc.nvrtcGetLTOIR(prog, ltoir)[0], "nvrtcGetLTOIR")
        return bytes(ltoir)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _check_nvrtc(err, what):
    from cuda.bindings import nvrtc
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"{what} failed: {err}")


def _nvjitlink(ltoirs, device_lib, arch):
    """Link LTO-IR modules (and ``device_lib`` unless None) into a cubin; returns (cubin, info log)."""
    from cuda.bindings import nvjitlink
    handle = nvjitlink.create(4, [f"-arch={arch}", "-lto", "-verbose", "-O3"])

    def log(getter_size, getter):
        n = getter_size(handle)
        buf = bytearray(n)
        if n:
            getter(handle, buf)
        return buf.decode(errors="replace").rstrip("\0")
    try:
        for name, data in ltoirs:
            nvjitlink.add_data(handle, nvjitlink.InputType.LTOIR, data, len(data), name)
        if device_lib is not None:
            nvjitlink.add_file(handle, nvjitlink.InputType.LIBRARY, str(device_lib))
        try:
            nvjitlink.complete(handle)
        except nvjitlink.nvJitLinkError as e:
            raise CompileError(f"nvJitLink failed ({e}):\n"
                               f"{log(nvjitlink.get_error_log_size, nvjitlink.get_error_log)}") from None
        info = log(nvjitlink.get_info_log_size, nvjitlink.get_info_log)
        cubin = bytearray(nvjitlink.get_linked_cubin_size(handle))
        nvjitlink.get_linked_cubin(handle, cubin)
        return bytes(cubin), info
    finally:
        nvjitlink.destroy(handle)


_PROPS = re.compile(r"Function properties for '(\w+)':\s*\n\s*info\s*:\s*used (\d+) registers.*?"
                    r"(\d+) stack, (\d+) bytes smem")
_SPILLS = re.compile(r"Function properties for (\w+)\s*\n\S*\s*\.\s*(\d+) bytes stack frame, "
                     r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_resources(info_log):
    """Per-kernel registers, stack, shared memory and spills from nvJitLink's verbose log: its per-function
    summary when it prints one (a link with a device library), else ptxas's lines."""
    spills = {m[0]: (int(m[2]), int(m[3])) for m in _SPILLS.findall(info_log)}
    out = {}
    for name, regs, stack, smem in _PROPS.findall(info_log):
        st, ld = spills.get(name, (0, 0))
        out[name] = dict(registers=int(regs), stack=int(stack), smem=int(smem),
                         spill_stores=st, spill_loads=ld)
    for name, r in _ptxas_resources(info_log).items():
        out.setdefault(name, r)
    return out


def _ptxas_resources(info_log):
    """ptxas's lines for each entry function: "Compiling entry function 'k'", its stack frame and spills,
    then "Used N registers[, used B barriers][, S bytes cumulative stack size][, M bytes smem]"."""
    out, current = {}, None
    for line in info_log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current = m[1]
            out[current] = dict(registers=0, stack=0, smem=0, spill_stores=0, spill_loads=0)
        elif current and (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                                         r"(\d+) bytes spill loads", line)):
            out[current].update(stack=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
        elif current and (m := re.search(r"Used (\d+) registers(?:, used \d+ barriers)?"
                                         r"(?:, \d+ bytes cumulative stack size)?(?:, (\d+) bytes smem)?", line)):
            out[current].update(registers=int(m[1]), smem=int(m[2] or 0))
            current = None
    return out


def _build_uncached(arch, variant, toolchain, src):
    v = VARIANTS[variant]
    sources = [src / name for name in v.sources]
    options = _nvrtc_options(toolchain, src, arch, variant)
    headers = toolchain.rtc_headers()
    workers = max(1, min(len(sources), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        ltoirs = list(zip((s.name for s in sources),
                          pool.map(lambda s: _nvrtc_compile(s, options, headers), sources)))
    cubin, info = _nvjitlink(ltoirs, toolchain.nvshmem_device_lib if v.nvshmem else None, arch)
    meta = json.dumps({"resources": parse_resources(info), "versions": toolchain.for_variant(variant)}).encode()
    return struct.pack("<Q", len(meta)) + meta + cubin


_memo = {}


def build(arch="sm_90", variant="nvshmem", use_cache=True):
    """Compile and link the kernels of ``variant`` (a key of :data:`VARIANTS`) for ``arch`` (e.g.
    ``"sm_90"``); no GPU needed.

    Served from memory, then from the disk cache (see :mod:`moecomm._cache`); a warm process compiles
    nothing. Raises CompileError carrying the NVRTC / nvJitLink log on failure.
    """
    if not re.fullmatch(r"sm_\d+a?", arch):
        raise ValueError(f"arch must look like 'sm_90', got {arch!r}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    toolchain, src = Toolchain.find(), source_dir()
    key = build_key(arch, variant, toolchain, src)
    if use_cache and key in _memo:
        return _memo[key]
    if use_cache:
        payload, hit = _cache.get_or_build(key, lambda: _build_uncached(arch, variant, toolchain, src))
    else:
        payload, hit = _build_uncached(arch, variant, toolchain, src), False
    (n,) = struct.unpack_from("<Q", payload)
    meta = json.loads(payload[8:8 + n])
    result = Build(arch, variant, payload[8 + n:], meta["resources"], key, hit)
    _memo[key] = result
    return result
