"""Data types accepted by moecomm, as numpy dtypes (ml_dtypes supplies bfloat16, float8_e4m3fn and
float8_e8m0fnu)."""
import ml_dtypes
import numpy as np

from ._errors import InvalidArgument

bfloat16 = np.dtype(ml_dtypes.bfloat16)
float16 = np.dtype(np.float16)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)
float32 = np.dtype(np.float32)
float8_e8m0fnu = np.dtype(ml_dtypes.float8_e8m0fnu)  # UE8M0: a power of two per byte (block scales)
int32 = np.dtype(np.int32)                           # as a scale dtype: four UE8M0 scales packed per int32
uint8 = np.dtype(np.uint8)                           # as in_dtype: opaque rows of bytes

_ALIASES = {
    "bfloat16": bfloat16, "bf16": bfloat16,
    "float16": float16, "fp16": float16, "half": float16,
    "float8_e4m3fn": float8_e4m3fn, "float8_e4m3": float8_e4m3fn, "fp8": float8_e4m3fn,
    "fp8_e4m3": float8_e4m3fn, "e4m3": float8_e4m3fn,
    "float32": float32, "fp32": float32,
    "float8_e8m0fnu": float8_e8m0fnu, "e8m0": float8_e8m0fnu, "ue8m0": float8_e8m0fnu,
    "int32": int32, "ue8m0x4": int32, "uint8": uint8, "bytes": uint8,
}

IN_DTYPES = (bfloat16, float16, float8_e4m3fn, uint8)
OUT_DTYPES = (bfloat16, float16)
SCALE_DTYPES = (float32, float8_e8m0fnu, int32)


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
