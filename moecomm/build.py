"""``python -m moecomm.build --arch sm_90``: compile and link every kernel in ``cuda/`` (no GPU needed).

Prints each kernel's registers, stack, shared memory and spills; exits non-zero if a kernel does not
build. Uses the disk cache unless ``--no-cache``.
"""
import argparse
import re
import sys
import time

from . import _jit
from ._errors import CompileError


def _arch(text):
    if not re.fullmatch(r"sm_\d+a?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a CUDA architecture like sm_90 or sm_90a")
    return text


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m moecomm.build", description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="sm_90", type=_arch, help="target, e.g. sm_90 (default) or sm_90a")
    p.add_argument("--no-cache", action="store_true", help="build even if the disk cache has it")
    args = p.parse_args(argv)
    t0 = time.time()
    try:
        b = _jit.build(args.arch, use_cache=not args.no_cache)
    except CompileError as e:
        print(e, file=sys.stderr)
        return 1
    print(f"{len(b.resources)} kernels for {b.arch}: cubin {len(b.cubin)} bytes, key {b.key}, "
          f"{'from cache' if b.cached else 'built'} in {time.time() - t0:.1f} s")
    print(f"{'kernel':<32} {'regs':>5} {'stack':>6} {'smem':>6} {'spill st':>9} {'spill ld':>9}")
    for name, r in sorted(b.resources.items()):
        print(f"{name:<32} {r['registers']:>5} {r['stack']:>6} {r['smem']:>6} "
              f"{r['spill_stores']:>9} {r['spill_loads']:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
