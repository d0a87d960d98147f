"""``python -m moecomm.build --arch sm_90``: compile and link every module variant's kernels (no GPU needed).

Builds each variant of ``moecomm._jit.VARIANTS`` (the ``nvshmem`` and ``ipc`` transports, the benchmark's
module) or those named by ``--variants``; prints each kernel's registers, stack, shared memory and
spills; exits non-zero if a kernel does not build. Uses the disk cache unless ``--no-cache``.
"""
import argparse
import re
import sys
import time

from . import _abi, _jit
from ._errors import CompileError


def _arch(text):
    supported = _jit.supported_archs()
    if not re.fullmatch(r"sm_\d+a?", text) or text.rstrip("a") not in supported:
        raise argparse.ArgumentTypeError(f"{text!r} is not a CUDA architecture this NVRTC builds for (one of "
                                         f"{', '.join(supported)}, with an 'a' suffix where the GPU has one)")
    return text


def _variants(text):
    names = [v for v in text.split(",") if v]
    unknown = [v for v in names if v not in _jit.VARIANTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {unknown or text!r}: expected some of "
                                         f"{','.join(_jit.VARIANTS)}")
    return names


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m moecomm.build", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="sm_90", type=_arch, help="target, e.g. sm_90 (default) or sm_90a")
    p.add_argument("--no-cache", action="store_true", help="build even if the disk cache has it")
    p.add_argument("--variants", default=",".join(_jit.VARIANTS), type=_variants,
                   help=f"comma-separated, of {','.join(_jit.VARIANTS)} (default: all)")
    args = p.parse_args(argv)
    for variant in args.variants:
        t0 = time.time()
        try:
            b = _jit.build(args.arch, variant, use_cache=not args.no_cache)
        except CompileError as e:
            print(e, file=sys.stderr)
            return 1
        print(f"{variant}: {len(b.resources)} kernels for {b.arch}: cubin {len(b.cubin)} bytes, key {b.key}, "
              f"{'from cache' if b.cached else 'built'} in {time.time() - t0:.1f} s")
        print(f"  {'kernel':<30} {'regs':>5} {'stack':>6} {'smem':>6} {'spill st':>9} {'spill ld':>9}")
        names = {k.symbol: k.cxx or k.name for k in _abi.KERNELS.values()}  # a C++ kernel by its C++ name
        for name, r in sorted((names.get(sym, sym), r) for sym, r in b.resources.items()):
            print(f"  {name:<30} {r['registers']:>5} {r['stack']:>6} {r['smem']:>6} "
                  f"{r['spill_stores']:>9} {r['spill_loads']:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
