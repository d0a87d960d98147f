"""What moecomm.jax needs from JAX's private modules, in one place, behind a version gate.

moecomm's operations are XLA FFI calls (``jax.ffi.ffi_call``, target names ``moecomm_*``). An AllToAll keeps
state from one call to the next, which neither JAX nor XLA can see, so three of the rules JAX applies to every
``ffi_call`` are changed for moecomm's, through JAX's internal tables (:func:`install`):

- **lowering**: the HLO custom call carries XLA's side-effect flag (XLA never drops, merges or duplicates a
  call), while to JAX the call is pure. A JAX effect would take a jitted function off JAX's C++ dispatch
  (``_get_fastpath_data`` refuses executables with effects: 0.4-0.5 ms per step of 8 layers on one H200).
- **dead-code elimination**: the call is kept whether or not its outputs are used.
- **jax.checkpoint** (remat's partial evaluation): the call's outputs are saved for the backward pass, never
  recomputed there, whatever the checkpoint's policy. A recomputed call would run the exchange again, and
  nothing orders it after the forward's calls: XLA may run a layer's recomputed dispatch before the forward's
  combine (seen on JAX's CPU backend, an unrolled stack of checkpointed layers).

And JAX's vmap tracer type (:data:`BatchTracer`), so that moecomm refuses vmap with its own message.

Tested: jax ``MIN_VERSION`` up to the ``NEXT_VERSION`` excluded (CI runs the JAX tests on the CPU with the oldest
and the newest the registry serves in that range; the GPU suite with the GPU machine's). Another version raises
:class:`UnsupportedJax` at ``import moecomm.jax``; ``MOECOMM_UNTESTED_JAX=1`` tries it anyway.
"""
import os

import jax

MIN_VERSION, NEXT_VERSION = (0, 9, 0), (0, 12, 0)
PREFIX = "moecomm_"  # the FFI targets whose rules change


class UnsupportedJax(ImportError):
    """moecomm.jax was imported with a JAX outside the tested range."""


def _version(text):
    """(major, minor, patch) of a version string such as '0.11.2' or '0.10.0.dev20260101'."""
    parts = []
    for p in text.split(".")[:3]:
        digits = "".join(c for c in p if c.isdigit()) if p[:1].isdigit() else ""
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (3 - len(parts)))


def _check_version():
    have = _version(jax.__version__)
    if MIN_VERSION <= have < NEXT_VERSION or os.environ.get("MOECOMM_UNTESTED_JAX") == "1":
        return
    lo, hi = ".".join(map(str, MIN_VERSION)), ".".join(map(str, NEXT_VERSION))
    raise UnsupportedJax(f"moecomm.jax supports jax >= {lo}, < {hi} (the range it is tested with); this is jax "
                         f"{jax.__version__}. Install a jax in that range, or set MOECOMM_UNTESTED_JAX=1 to try "
                         "this one (moecomm.jax changes three of JAX's internal rules for its calls: "
                         "moecomm/_jax_internals.py)")


_check_version()
try:
    from jax._src import core as _core
    from jax._src import ffi as _ffi
    from jax._src.interpreters import partial_eval as _pe
    from jax._src.interpreters.batching import BatchTracer  # noqa: F401 (moecomm.jax refuses vmap by it)
    from jax.interpreters import mlir as _mlir
    _lower, _default_dce = _ffi.ffi_call_lowering, _pe.dce_rules.get(_ffi.ffi_call_p, _pe._default_dce_rule)
    _ffi_call_p = _ffi.ffi_call_p
except (ImportError, AttributeError) as e:  # inside the range these exist; under MOECOMM_UNTESTED_JAX they may not
    raise UnsupportedJax(f"moecomm.jax: this jax ({jax.__version__}) lacks an internal it needs: {e}") from e


def _ours(eqn):
    return eqn.params["target_name"].startswith(PREFIX)


def _lowering(ctx, *operands, target_name, has_side_effect, **params):
    return _lower(ctx, *operands, target_name=target_name,
                  has_side_effect=has_side_effect or target_name.startswith(PREFIX), **params)


def _dce(used_outputs, eqn):
    if _ours(eqn):
        return [True] * len(eqn.invars), eqn
    return _default_dce(used_outputs, eqn)


def _remat(saveable, unks_in, inst_in, eqn):
    """Remat's partial evaluation of an ffi_call: JAX's own handling of a primitive without a rule (unknown
    inputs: staged; known: saved or recomputed as ``saveable`` says; a call with an effect: saved), except that
    moecomm's calls with known inputs are always saved. (JAX's offloading policies recompute other FFI calls
    here instead of offloading their outputs.)"""
    n = len(eqn.outvars)
    residuals = [v for v, inst in zip(eqn.invars, inst_in) if isinstance(v, _core.Var) and not inst]
    if any(unks_in):
        return None, eqn, [True] * n, [True] * n, residuals
    policy = _pe.ensure_enum(saveable(eqn.primitive, *[v.aval for v in eqn.invars], **eqn.params))
    if _ours(eqn) or eqn.effects or isinstance(policy, _pe.SaveableType):
        return eqn, None, [False] * n, [False] * n, []
    return eqn, eqn, [False] * n, [True] * n, residuals


def install():
    """Change the three rules for moecomm's FFI calls (idempotent; process-wide, other FFI calls unchanged)."""
    _mlir.register_lowering(_ffi_call_p, _lowering)
    _pe.dce_rules[_ffi_call_p] = _dce
    _pe.partial_eval_jaxpr_custom_rules[_ffi_call_p] = _remat
