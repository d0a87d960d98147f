"""Arrays at the API's edge: numpy for the host transport; for GPUs, anything that describes device memory.

Device arrays are read by the first rule that fits their type (chosen once per type, then looked up):

* :class:`DeviceBuffer` (raw pointer, shape, dtype, device);
* CuPy arrays and PyTorch tensors, by their attributes (a fraction of a microsecond; no DLPack capsule,
  no ``__cuda_array_interface__`` dict). Neither carries a stream: the producer is taken to be the
  framework's current stream on the rank's device, and when that is not the launch stream, the launch
  stream is made to wait for it (what DLPack would do);
* anything with ``__dlpack__``: called with ``stream=`` the launch stream, so the producer orders its work
  before ours (JAX arrays, other frameworks);
* anything with ``__cuda_array_interface__``: its ``stream`` field (version 3), when given and not the
  launch stream, is waited for the same way.

Any exception a producer raises while being read becomes :class:`InvalidArgument` naming the argument.
bfloat16 and float8 may arrive as raw types of the same size (``V2``/``u2`` for bf16, ``u1``/``i1``/``V1``
for fp8), since not every framework names them. An output must be writable: a read-only numpy array, a
``__cuda_array_interface__`` marked read-only and a JAX array (immutable; ``moecomm.jax`` hands out its
own outputs) are refused.
"""
import ctypes
import sys
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np

from ._dtypes import _ALIASES
from ._errors import InvalidArgument


@dataclass(frozen=True, init=False)
class DeviceBuffer:
    """A C-contiguous array in device memory described by a raw pointer.

    Args:
        ptr: device address (int).
        shape: tuple of ints (any sequence of integers, kept as a tuple of ints).
        dtype: numpy dtype of the elements (ml_dtypes for bfloat16 / float8_e4m3fn), or what np.dtype takes.
        device: CUDA device ordinal the memory lives on (-1: not checked).
        owner: any object that must stay alive while the pointer is used (not inspected).
    """
    ptr: int
    shape: tuple
    dtype: np.dtype
    device: int = -1
    owner: object = None

    def __init__(self, ptr, shape, dtype, device=-1, owner=None):
        # normalised once, so that reading a buffer costs nothing per call; the fields written straight into
        # the instance (frozen): ~1 µs per buffer less than the dataclass's own __init__, and a framework
        # layer (moecomm.jax) makes one per array per call
        fields = self.__dict__
        fields["ptr"], fields["shape"], fields["device"], fields["owner"] = ptr, tuple(map(int, shape)), device, owner
        fields["dtype"] = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)

    @property
    def nbytes(self):
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


class Accepted(dict):
    """{dtype an argument may arrive as: the dtype it is read as}, and ``names``, what to tell a caller."""

    def __init__(self, mapping, names):
        super().__init__(mapping)
        self.names = names


def accepted(*dtypes):
    """What arguments of the given dtypes accept: bfloat16 and the float8 types may also arrive as raw
    integers or void of their size (not every framework names them)."""
    out = {}
    for want in map(np.dtype, dtypes):
        out[want] = want
        if want.name in ("bfloat16", "float8_e4m3fn", "float8_e8m0fnu"):
            for kind in "uiV":
                out.setdefault(np.dtype(f"{kind}{want.itemsize}"), want)
    return Accepted(out, " or ".join(str(np.dtype(d)) for d in dtypes))


def fits(shape, want):
    """Whether ``shape`` matches ``want``, whose first size may be None (a 2-D ``(None, n)``: any number of
    rows of n)."""
    return shape == want or (want[0] is None and len(shape) == len(want) and shape[1:] == want[1:])


def check(name, dtype, shape, contiguous, accept, want_shape):
    """The dtype ``dtype`` is read as; raise InvalidArgument unless dtype, shape and contiguity fit."""
    got = accept.get(dtype)
    if got is None:
        shown = dtype if dtype is not None else "unknown"
        raise InvalidArgument(f"{name}: dtype {shown} does not match expected {accept.names}")
    if not fits(shape, want_shape):
        shown = tuple("*" if w is None else w for w in want_shape)
        raise InvalidArgument(f"{name}: shape {tuple(shape)} does not match expected {shown}")
    if not contiguous:
        raise InvalidArgument(f"{name}: must be C-contiguous")
    return got


class _Reading:
    """What reading a call's arrays keeps besides their values (HostArrays, DeviceArrays): ``rows``, the fewest
    rows of the per-token arrays (those whose expected shape starts with None) read since :meth:`begin` (each
    may have at most ``max_rows``, the AllToAll's max_num_tokens); ``dtype``, the dtype the last array read is
    read as (a value of its ``accept`` map; :meth:`read_as` returns it)."""

    def __init__(self, max_rows):
        self.max_rows = self.rows = max_rows
        self.dtype = None

    def read_as(self, obj, name, accept, shape, output=False):
        """``(read(...), the dtype it is read as)``: for an argument whose dtype the call needs (int64 ids, a
        gradient's float dtype)."""
        return self.read(obj, name, accept, shape, output), self.dtype

    def _count(self, name, shape):
        """Count the rows of a per-token array of ``shape`` (already checked against its expected shape)."""
        n = shape[0]
        if n > self.max_rows:
            raise InvalidArgument(f"{name}: expected at most max_num_tokens={self.max_rows} rows, got shape "
                                  f"{tuple(shape)}")
        if n < self.rows:
            self.rows = n

    def marks(self, args):
        """What a promised call (moecomm.DispatchArgs.promised) must keep for its reading to be reused: for each
        of the arrays of ``args`` (its ``array_fields``) that may change in place, (name, array, fingerprint);
        None where one can be checked only by reading it again (numpy arrays here)."""
        return None

    def producers(self):
        """The producers the reading since :meth:`begin` found (none on the host)."""
        return frozenset()


class HostArrays(_Reading):
    """numpy arrays for the host transport: a value is the array itself, viewed as its expected dtype.
    ``buffers`` (as DeviceArrays'): always False, numpy arrays being mutable."""
    memory = "host"
    buffers = False

    def begin(self, stream, first):
        """Start reading a call's arrays; its stream: none on the host."""
        self.rows = self.max_rows
        return None

    def read(self, obj, name, accept, shape, output=False):
        """A checked numpy array, viewed as the dtype it is read as (``self.dtype``); ``shape``'s first size
        may be None (a per-token array: ``self.rows``); ``output``: it must be writable."""
        self.buffers = False
        if not isinstance(obj, np.ndarray):
            raise InvalidArgument(f"{name}: the host transport takes numpy arrays, got {type(obj).__name__}")
        self.dtype = dt = check(name, obj.dtype, obj.shape, obj.flags.c_contiguous, accept, shape)
        if output and not obj.flags.writeable:
            raise InvalidArgument(f"{name}: an output, but the array is read-only")
        if shape[0] is None:
            self._count(name, obj.shape)
        return obj.view(dt)

    @staticmethod
    def address(value):
        """The first byte of a value :meth:`read` returned."""
        return value.__array_interface__["data"][0]

    def order(self):
        pass

    def close(self):
        pass



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
_CAPSULE_POINTER = ctypes.pythonapi.PyCapsule_GetPointer
_CAPSULE_POINTER.restype, _CAPSULE_POINTER.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


def _named(name):
    return _ALIASES.get(name) or np.dtype(name)


def _c_contiguous(shape, strides_elems):
    expect = 1
    for n, s in zip(reversed(shape), reversed(strides_elems)):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


# A reader returns (ptr, shape, dtype or None, contiguous, device, producer, readonly) of an array, given the
# call's launch stream (which only DLPack producers need): device None when unknown (checked by pointer) or -1
# (not checked), producer the stream the data was written on (an int handle, None when already ordered or
# unknown, or _CUPY / _TORCH for "that framework's current stream"), readonly whether the producer says the
# memory must not be written. The caller holds the array for the call; a DLPack capsule may go once read (the
# producer's array keeps the memory). DeviceBuffers, CuPy arrays and PyTorch tensors are read in
# DeviceArrays.read itself: their reader is a tag, _BUFFER, _CUPY or _TORCH.
_CUPY, _TORCH = "cupy", "torch"
_BUFFER = "buffer"
_TORCH_DTYPES = {}  # torch.dtype -> numpy dtype (None: not one we read), filled as dtypes are seen


_PLAIN = nullcontext()


def torch_function_off():
    """A context for reading a call's arrays: torch's ``__torch_function__`` handling off where a torch function
    mode is on (``torch.set_default_device``'s sees every tensor method, ~1 µs each, and reading a tensor calls five),
    else a null one. torch is not imported here: it is looked up where the caller has imported it."""
    torch = sys.modules.get("torch")
    if torch is None or not torch._C._is_torch_function_mode_enabled():
        return _PLAIN
    return torch._C.DisableTorchFunction()


def _torch_dtype(d):
    dt = _TORCH_DTYPES.get(d)
    if dt is None and d not in _TORCH_DTYPES:
        name = str(d).rpartition(".")[2]  # "torch.bfloat16" -> "bfloat16"
        dt = _TORCH_DTYPES[d] = _named(name) if name in _DL_DTYPES.values() else None
    return dt


def _dlpack_stream(stream):
    return 1 if stream == 0 else stream  # DLPack: 1 is the legacy default stream, 0 is not allowed


def _dltensor(capsule):
    """The DLTensor of a DLPack capsule (a DLManagedTensor starts with it): (address, shape, dtype or None,
    C-contiguous, DLDevice)."""
    t = _DLTensor.from_address(_CAPSULE_POINTER(capsule, b"dltensor"))
    name = _DL_DTYPES.get((t.dtype.code, t.dtype.bits))
    dtype = _named(name) if name is not None and t.dtype.lanes == 1 else None
    shape = tuple(t.shape[i] for i in range(t.ndim))
    contiguous = not t.strides or _c_contiguous(shape, [t.strides[i] for i in range(t.ndim)])
    return int(t.data or 0) + int(t.byte_offset), shape, dtype, contiguous, t.device


def _read_dlpack(obj, stream):
    ptr, shape, dtype, contiguous, device = _dltensor(obj.__dlpack__(stream=_dlpack_stream(stream)))
    if device.device_type not in (_DL_CUDA, _DL_CUDA_MANAGED):
        raise InvalidArgument(f"DLPack device type {device.device_type} is not CUDA memory")
    # JAX arrays are immutable (XLA may share their memory): never an output (moecomm.jax makes its own)
    readonly = type(obj).__module__.startswith(("jax", "jaxlib"))
    return ptr, shape, dtype, contiguous, device.device_id, None, readonly


def host_array(ptr, shape, dtype):
    """A writable numpy view of the C-contiguous host memory at address ``ptr`` (0 for an empty array)."""
    n = int(np.prod(shape, dtype=np.int64))
    raw = (ctypes.c_char * max(1, n * dtype.itemsize)).from_address(ptr) if ptr else bytearray(dtype.itemsize)
    return np.frombuffer(raw, dtype, count=n).reshape(shape)


def _read_cai(obj, stream):
    cai = obj.__cuda_array_interface__
    ptr, readonly = int(cai["data"][0]), bool(cai["data"][1])
    shape = tuple(int(n) for n in cai["shape"])
    dtype = np.dtype(cai["typestr"])
    strides = cai.get("strides")
    contiguous = strides is None or _c_contiguous(shape, [s // dtype.itemsize for s in strides])
    producer = cai.get("stream")  # v3: None = no ordering needed; 1/2 = legacy/per-thread default
    if producer == 1:
        producer = 0
    return ptr, shape, dtype, contiguous, None, producer, readonly


def _reader_for(cls):
    """The reader for objects of type ``cls`` (decided once per type)."""
    if cls is DeviceBuffer:
        return _BUFFER
    try:
        import cupy
        if issubclass(cls, cupy.ndarray):
            return _CUPY
    except ImportError:
        pass
    if all(hasattr(cls, a) for a in ("data_ptr", "is_contiguous", "get_device")):  # torch, or quacks like it
        return _TORCH
    if hasattr(cls, "__dlpack__") and not issubclass(cls, np.ndarray):
        return _read_dlpack
    if hasattr(cls, "__cuda_array_interface__"):
        return _read_cai
    return None


_READERS = {}


def _fingerprint(reader, obj):
    """What reading a CuPy array or a torch tensor depends on and may change in place: its address, shape,
    dtype, contiguity (and a tensor's device); None for other kinds."""
    if reader is _CUPY:
        return obj.data.ptr, obj.shape, obj.dtype, obj._c_contiguous
    if reader is _TORCH:
        return obj.data_ptr(), obj.shape, obj.dtype, obj.is_contiguous(), obj.get_device()
    return None


def _reader(obj):
    reader = _READERS.get(type(obj))
    if reader is None:
        reader = _READERS[type(obj)] = _reader_for(type(obj))
    return reader


class DeviceArrays(_Reading):
    """Reads device arrays for one AllToAll on CUDA device ``device`` (one call at a time).

    Per call: :meth:`begin` resolves the launch stream, :meth:`read` reads and checks each argument,
    :meth:`order` makes the launch stream wait for the producers of what was read. ``buffers``: set
    True by the caller, cleared by :meth:`read` for an array that is not a :class:`DeviceBuffer` (whose
    reading the next call cannot reuse: its shape or memory may have changed in place).
    """
    memory = "device"
    buffers = False

    def __init__(self, device, stream_order, pointer_device, max_rows):
        super().__init__(max_rows)
        self.device = device
        self._order, self._pointer_device = stream_order, pointer_device
        self._producers = set()
        self._stream, self._implied = 0, None  # _implied: the framework whose stream was taken as ours

    def begin(self, stream, first):
        """Start reading a call's arrays; returns its launch stream (a handle) for ``stream``: None means the
        current stream of the framework of ``first`` (the call's first array) on this device: PyTorch's for a
        tensor, else CuPy's. DLPack producers are asked to order their work before it in :meth:`read`."""
        self._producers.clear()
        self.rows = self.max_rows
        if type(stream) is int:  # the common case, first
            self._implied, self._stream = None, stream
        elif stream is None:  # that framework's arrays are then written on the launch stream itself
            self._implied = _TORCH if _reader(first) is _TORCH else _CUPY
            self._stream = self._framework_stream(self._implied)
        else:
            self._implied, self._stream = None, stream_handle(stream)
        return self._stream

    def _framework_stream(self, which):
        if which is _TORCH:
            import torch
            return torch._C._cuda_getCurrentRawStream(self.device)
        import cupy
        return cupy.cuda.get_current_stream(self.device).ptr

    def read(self, obj, name, accept, shape, output=False):
        """A checked device array's device address, as :meth:`HostArrays.read` (``self.dtype``: the dtype it is
        read as; ``self.rows``)."""
        reader = _READERS.get(type(obj)) or _reader(obj)
        if reader is _BUFFER:  # the fastest path: no producer, never read-only
            ptr, shp, dev = obj.ptr, obj.shape, obj.device
            got = accept.get(obj.dtype)
            if (got is None or ptr & 15 or (dev != self.device and dev != -1)
                    or (shp != shape and (shape[0] is not None or len(shp) != 2 or shp[1] != shape[1]))):
                got = self._refuse(name, ptr, shp, obj.dtype, True, dev, accept, shape)
            self.dtype = got
            if shape[0] is None:
                self._count(name, shp)
            return ptr
        if reader is None:
            raise InvalidArgument(
                f"{name}: expected a device array (CuPy array, PyTorch tensor, __dlpack__, "
                f"__cuda_array_interface__ or moecomm.DeviceBuffer), got {type(obj).__name__}")
        readonly, self.buffers = False, False
        try:  # CuPy and torch by their attributes, here (no reader call: the hot path of every argument)
            if reader is _CUPY:
                memory = obj.data
                ptr, shp, dt, contiguous, dev = memory.ptr, obj.shape, obj.dtype, obj._c_contiguous, memory.device_id
                producer = _CUPY
            elif reader is _TORCH:  # get_device() is -1 for CPU tensors: their pointer is checked (and refused)
                ptr, shp, dt, contiguous = obj.data_ptr(), obj.shape, _torch_dtype(obj.dtype), obj.is_contiguous()
                dev = obj.get_device()
                dev, producer = dev if dev >= 0 else None, _TORCH
            else:
                ptr, shp, dt, contiguous, dev, producer, readonly = reader(obj, self._stream)
        except InvalidArgument as e:
            raise InvalidArgument(f"{name}: {e}") from None
        except Exception as e:  # the producer's own error (torch raises KeyError for bf16 CAI, ...)
            raise InvalidArgument(f"{name}: could not read the {type(obj).__name__} "
                                  f"({type(e).__name__}: {e})") from None
        got = accept.get(dt)
        # the common case first in each test: per-token arrays (any rows) are 2-D, fixed shapes match
        if (got is None or not contiguous or ptr & 15 or (dev != self.device and dev != -1)
                or (shp != shape and (shape[0] is not None or len(shp) != 2 or shp[1] != shape[1]))):
            got = self._refuse(name, ptr, shp, dt, contiguous, dev, accept, shape)
        if output and readonly:
            raise InvalidArgument(f"{name}: an output, but the {type(obj).__name__} is read-only"
                                  + (" (JAX arrays are immutable: use moecomm.jax)" if "jax" in type(obj).__module__
                                     else ""))
        if producer is not None:
            self._producers.add(producer)
        self.dtype = got
        if shape[0] is None:
            self._count(name, shp)
        return ptr

    @staticmethod
    def address(value):
        """The first byte of a value :meth:`read` returned: the value itself."""
        return value

    def marks(self, args):
        """As :meth:`HostArrays.marks`: CuPy arrays and torch tensors by their attributes (DeviceBuffers are
        immutable: none); None where another kind (DLPack, ``__cuda_array_interface__``) is among them."""
        out = []
        for name in args.array_fields:
            obj = getattr(args, name)
            reader = _reader(obj) if obj is not None else _BUFFER
            if reader is not _BUFFER:
                mark = _fingerprint(reader, obj)
                if mark is None:
                    return None
                out.append((name, obj, mark))
        return tuple(out)

    def check_marks(self, marks, producers):
        """Raise InvalidArgument naming the first promised array whose fingerprint differs from its mark (as
        :meth:`marks` made them); else the launch stream will wait for ``producers``, as after reading them."""
        for name, obj, mark in marks:
            if _fingerprint(_READERS[type(obj)], obj) != mark:
                raise InvalidArgument(f"{name}: its address, shape, dtype or layout changed since the call was "
                                      f"prepared (a prepared call takes the same arrays every time)")
        self._producers.update(producers)

    def producers(self):
        return frozenset(self._producers)

    def _refuse(self, name, ptr, shape, dtype, contiguous, device, accept, want):
        """Raise what is wrong with an argument the fast check refused; return its dtype when only its
        device was unknown (then looked up by pointer) and is right."""
        got = check(name, dtype, shape, contiguous, accept, want)
        if device is None and ptr:
            device = self._pointer_device(ptr)
            if device is None:
                raise InvalidArgument(f"{name}: memory at {ptr:#x} is not device memory")
        if device != self.device and device != -1:
            raise InvalidArgument(f"{name}: memory is on device {device}, expected device {self.device}")
        if ptr % 16:
            raise InvalidArgument(f"{name}: device pointer {ptr:#x} must be 16-byte aligned")
        return got

    def order(self):
        """Make the launch stream wait for every producer stream seen since :meth:`begin` (no-op when they
        are the launch stream, the common case)."""
        for p in self._producers:
            if p is self._implied:
                continue
            handle = self._framework_stream(p) if isinstance(p, str) else p
            if handle != self._stream:
                self._order.after(handle, self._stream)

    def close(self):
        """Release the event used for ordering (in the rank's context)."""
        self._order.destroy()



def stream_handle(stream):
    """A CUDA stream handle (int) from an int, or an object with ``__cuda_stream__`` (cuda.core),
    ``.ptr`` (CuPy) or ``.cuda_stream`` (PyTorch)."""
    if isinstance(stream, (int, np.integer)):
        return int(stream)
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    for attr in ("ptr", "cuda_stream"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    raise InvalidArgument(f"stream: cannot get a CUDA stream handle from {type(stream).__name__}")
