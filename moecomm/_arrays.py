"""Arrays at the API's edge: numpy for the host transport; for GPUs, anything that describes device memory.

Device arrays are accepted as :class:`DeviceBuffer` (the raw-pointer layer), as any object with
``__cuda_array_interface__`` (CuPy, Numba, PyTorch, ...) or ``__dlpack__`` (JAX, PyTorch, CuPy). All are
reduced to a DeviceBuffer: pointer, shape, dtype, device. bfloat16 and float8 may arrive as raw types of the
same size (``V2``/``u2`` for bf16, ``u1``/``i1``/``V1`` for fp8), since not every framework names them.
"""
import ctypes
from dataclasses import dataclass

import numpy as np

from ._dtypes import _ALIASES
from ._errors import InvalidArgument


@dataclass(frozen=True)
class DeviceBuffer:
    """A C-contiguous array in device memory described by a raw pointer.

    Args:
        ptr: device address (int).
        shape: tuple of ints.
        dtype: numpy dtype of the elements (ml_dtypes for bfloat16 / float8_e4m3fn).
        device: CUDA device ordinal the memory lives on (-1: not checked).
        owner: any object that must stay alive while the pointer is used (not inspected).
    """
    ptr: int
    shape: tuple
    dtype: np.dtype
    device: int = -1
    owner: object = None

    @property
    def nbytes(self):
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


_RAW_KINDS = {1: "uViS", 2: "uViS"}  # kinds a special dtype may arrive as, by itemsize


def _compatible(got, want):
    got, want = np.dtype(got), np.dtype(want)
    if got == want:
        return True
    special = want.kind == "V" or want.name in ("bfloat16", "float8_e4m3fn")
    return special and got.itemsize == want.itemsize and got.kind in _RAW_KINDS.get(got.itemsize, "")


def check(name, dtype, shape, contiguous, want_dtype, want_shape):
    """Raise InvalidArgument unless dtype/shape/contiguity match. ``None`` in want_shape matches any size."""
    if not _compatible(dtype, want_dtype):
        raise InvalidArgument(f"{name}: dtype {np.dtype(dtype)} does not match expected {np.dtype(want_dtype)}")
    if len(shape) != len(want_shape) or any(w is not None and s != w for s, w in zip(shape, want_shape)):
        shown = tuple("*" if w is None else w for w in want_shape)
        raise InvalidArgument(f"{name}: shape {tuple(shape)} does not match expected {shown}")
    if not contiguous:
        raise InvalidArgument(f"{name}: must be C-contiguous")


def host_array(obj, name, dtype, shape, writable=False):
    """Check a numpy array for the host transport and return it viewed as ``dtype``."""
    if not isinstance(obj, np.ndarray):
        raise InvalidArgument(f"{name}: the host transport takes numpy arrays, got {type(obj).__name__}")
    check(name, obj.dtype, obj.shape, obj.flags.c_contiguous, dtype, shape)
    if writable and not obj.flags.writeable:
        raise InvalidArgument(f"{name}: must be writable")
    return obj.view(dtype)


# --- device arrays -----------------------------------------------------------------------------

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_DL_CUDA, _DL_CUDA_MANAGED = 2, 13
# (DLPack type code, bits) -> numpy dtype name; codes from dlpack.h (kDLInt 0, kDLUInt 1, kDLFloat 2,
# kDLBfloat 4, kDLFloat8_e4m3fn 10).
_DL_DTYPES = {(0, 8): "int8", (0, 16): "int16", (0, 32): "int32", (0, 64): "int64",
              (1, 8): "uint8", (1, 16): "uint16", (1, 32): "uint32", (1, 64): "uint64",
              (2, 16): "float16", (2, 32): "float32", (2, 64): "float64",
              (4, 16): "bfloat16", (10, 8): "float8_e4m3fn"}


def _c_contiguous(shape, strides_elems):
    expect = 1
    for n, s in zip(reversed(shape), reversed(strides_elems)):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def _from_cai(obj):
    cai = obj.__cuda_array_interface__
    ptr = int(cai["data"][0])
    shape = tuple(int(n) for n in cai["shape"])
    dtype = np.dtype(cai["typestr"])
    strides = cai.get("strides")
    contiguous = strides is None or _c_contiguous(shape, [s // dtype.itemsize for s in strides])
    return ptr, shape, dtype, contiguous, None


def _from_dlpack(obj):
    capsule = obj.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    t = _DLTensor.from_address(get(capsule, b"dltensor"))  # DLManagedTensor starts with its DLTensor
    if t.device.device_type not in (_DL_CUDA, _DL_CUDA_MANAGED):
        raise InvalidArgument(f"DLPack device type {t.device.device_type} is not CUDA memory")
    name = _DL_DTYPES.get((t.dtype.code, t.dtype.bits))
    if name is None or t.dtype.lanes != 1:
        raise InvalidArgument(f"unsupported DLPack dtype code={t.dtype.code} bits={t.dtype.bits}")
    dtype = _ALIASES.get(name) or np.dtype(name)
    shape = tuple(t.shape[i] for i in range(t.ndim))
    contiguous = not t.strides or _c_contiguous(shape, [t.strides[i] for i in range(t.ndim)])
    return int(t.data or 0) + int(t.byte_offset), shape, dtype, contiguous, capsule


def _pointer_device(ptr):
    import cupy
    attrs = cupy.cuda.runtime.pointerGetAttributes(ptr)
    if attrs.type not in (2, 3):  # cudaMemoryTypeDevice, cudaMemoryTypeManaged
        return None
    return attrs.device


def device_array(obj, name, dtype, shape, device):
    """Describe ``obj`` as a DeviceBuffer after checking dtype, shape, contiguity and device."""
    if isinstance(obj, DeviceBuffer):
        ptr, shp, dt, contiguous, owner = obj.ptr, tuple(obj.shape), np.dtype(obj.dtype), True, obj.owner
    elif hasattr(obj, "__cuda_array_interface__"):
        ptr, shp, dt, contiguous, owner = _from_cai(obj)
    elif hasattr(obj, "__dlpack__") and not isinstance(obj, np.ndarray):
        ptr, shp, dt, contiguous, owner = _from_dlpack(obj)
    else:
        raise InvalidArgument(
            f"{name}: expected a device array (CuPy array, __cuda_array_interface__, __dlpack__ or "
            f"moecomm.DeviceBuffer), got {type(obj).__name__}")
    check(name, dt, shp, contiguous, dtype, shape)
    if ptr and device >= 0:
        on = _pointer_device(ptr)
        if on != device:
            where = "host memory" if on is None else f"device {on}"
            raise InvalidArgument(f"{name}: memory is on {where}, expected device {device}")
    return DeviceBuffer(ptr, shp, np.dtype(dtype), device, owner if owner is not None else obj)
