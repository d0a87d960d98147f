"""Data types accepted by moecomm, as numpy dtypes (ml_dtypes supplies bfloat16 and float8_e4m3fn)."""
import ml_dtypes
import numpy as np

from ._errors import InvalidArgument

bfloat16 = np.dtype(ml_dtypes.bfloat16)
float16 = np.dtype(np.float16)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)
float32 = np.dtype(np.float32)

_ALIASES = {
    "bfloat16": bfloat16, "bf16": bfloat16,
    "float16": float16, "fp16": float16, "half": float16,
    "float8_e4m3fn": float8_e4m3fn, "float8_e4m3": float8_e4m3fn, "fp8": float8_e4m3fn,
    "fp8_e4m3": float8_e4m3fn, "e4m3": float8_e4m3fn,
    "float32": float32, "fp32": float32,
}

IN_DTYPES = (bfloat16, float16, float8_e4m3fn)
OUT_DTYPES = (bfloat16, float16)
SCALE_DTYPES = (float32,)

def as_dtype(value, allowed, what):
    """Return the numpy dtype named by ``value`` (a dtype, a type or a name) if it is in ``allowed``.

    Raises InvalidArgument naming ``what`` and the allowed names otherwise.
    """
    if isinstance(value, str):
        dt = _ALIASES.get(value.lower())
    else:
        try:
            dt = np.dtype(value)
        except TypeError:
            dt = None
    if dt is None or dt not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise InvalidArgument(f"{what}: unsupported dtype {value!r}; expected one of {names}")
    return dt
