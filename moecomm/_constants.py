"""Constants shared by Python and device code.

Defined once here; :func:`device_defines` turns them into ``-D`` flags for every kernel build, so the
build-cache key covers them and no ``.cu`` file repeats a number.
"""
import os

# Device error word (int32[4]): code, peer rank, phase, detail. The first error of a call wins.
ERR_NONE = 0
ERR_TIMEOUT = 1       # a bounded wait expired; peer = rank waited for
ERR_BAD_EXPERT = 2    # an expert id outside [0, num_experts) or repeated in a token; detail = token index
ERROR_WORDS = 4

PHASES = ("peer_check", "dispatch", "combine")
PHASE_PEER_CHECK, PHASE_DISPATCH, PHASE_COMBINE = range(len(PHASES))

# Bounded waits. Default in seconds, overridable per object and by one environment variable.
DEFAULT_TIMEOUT_S = 10.0
TIMEOUT_ENV = "MOECOMM_TIMEOUT_S"

# Largest supported routing configuration (device code sizes per-token arrays with these).
MAX_TOPK = 16
MAX_EXPERTS = 512

# Largest peer check (Communicator.check_peers); its buffers are allocated at init.
PEER_CHECK_BYTES = 1 << 16

# Alignment of one token row in bytes (kernels copy rows with 16-byte vector accesses).
ROW_ALIGN = 16


def timeout_seconds(value=None):
    """Resolve a timeout: the argument, else ``$MOECOMM_TIMEOUT_S``, else the default.

    Returns ``(seconds, source)`` where source says where the value came from (for logs and errors).
    """
    if value is not None:
        seconds, source = float(value), "argument"
    elif os.environ.get(TIMEOUT_ENV):
        seconds, source = float(os.environ[TIMEOUT_ENV]), TIMEOUT_ENV
    else:
        seconds, source = DEFAULT_TIMEOUT_S, "default"
    if not seconds > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {seconds} (from {source})")
    return seconds, source


def device_defines():
    """The constants above as NVRTC ``-D`` options."""
    values = {
        "ERR_NONE": ERR_NONE, "ERR_TIMEOUT": ERR_TIMEOUT, "ERR_BAD_EXPERT": ERR_BAD_EXPERT,
        "ERROR_WORDS": ERROR_WORDS, "MAX_TOPK": MAX_TOPK, "MAX_EXPERTS": MAX_EXPERTS,
        "ROW_ALIGN": ROW_ALIGN,
        "PHASE_PEER_CHECK": PHASE_PEER_CHECK, "PHASE_DISPATCH": PHASE_DISPATCH,
        "PHASE_COMBINE": PHASE_COMBINE,
    }
    return [f"-DMOECOMM_{k}={v}" for k, v in sorted(values.items())]
