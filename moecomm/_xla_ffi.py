"""XLA's FFI C API (``xla/ffi/api/c_api.h``) as ctypes structures: what moecomm.jax needs to register Python
functions as XLA FFI handlers, with no compiler involved.

A handler gets a call frame: the stage, the arguments and results (device or host buffers), the attributes
(here one int64 scalar, found by name), and an API table to ask for the CUDA stream and to make errors. XLA
first calls every handler with a metadata extension to learn its API version and traits; a handler marked command-buffer
compatible is traced into XLA's command buffers (CUDA graphs): it runs under stream capture when XLA records
the graph, and XLA replays what it captured, with no Python, until the buffers' addresses change. The same
layout serves JAX's CPU backend (buffers in host memory, no stream).

Only the fields moecomm reads are named; the structures are those of XLA's API version 0.1 (jax 0.5 and later).
"""
import ctypes
import enum

import numpy as np

from ._dtypes import bfloat16, float8_e4m3fn, float8_e8m0fnu

_P = ctypes.c_void_p
_SIZE = ctypes.c_size_t


class _ExtensionBase(ctypes.Structure):
    pass


_ExtensionBase._fields_ = [("struct_size", _SIZE), ("type", ctypes.c_int), ("next", ctypes.POINTER(_ExtensionBase))]
_METADATA_EXTENSION = 1  # XLA_FFI_Extension_Metadata
COMMAND_BUFFER_COMPATIBLE = 1  # XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE


class _ApiVersion(ctypes.Structure):
    _fields_ = [("struct_size", _SIZE), ("extension_start", _P), ("major_version", ctypes.c_int),
                ("minor_version", ctypes.c_int)]


class _Metadata(ctypes.Structure):
    _fields_ = [("struct_size", _SIZE), ("api_version", _ApiVersion), ("traits", ctypes.c_uint32)]


class _MetadataExtension(ctypes.Structure):
    _fields_ = [("extension_base", _ExtensionBase), ("metadata", ctypes.POINTER(_Metadata))]


class Buffer(ctypes.Structure):
    """XLA_FFI_Buffer: ``dtype`` (XLA_FFI_DataType), ``data`` (address), ``rank``, ``dims``."""
    _fields_ = [("struct_size", _SIZE), ("extension_start", _P), ("dtype", ctypes.c_int), ("data", _P),
                ("rank", ctypes.c_int64), ("dims", ctypes.POINTER(ctypes.c_int64))]


class _List(ctypes.Structure):  # XLA_FFI_Args, XLA_FFI_Rets
    _fields_ = [("struct_size", _SIZE), ("extension_start", _P), ("size", ctypes.c_int64),
                ("types", ctypes.POINTER(ctypes.c_int)), ("items", ctypes.POINTER(ctypes.POINTER(Buffer)))]


class _Scalar(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int), ("value", _P)]


class _ByteSpan(ctypes.Structure):  # XLA_FFI_ByteSpan: an attribute's name
    _fields_ = [("ptr", _P), ("len", _SIZE)]


class _Attrs(ctypes.Structure):
    _fields_ = [("struct_size", _SIZE), ("extension_start", _P), ("size", ctypes.c_int64),
                ("types", ctypes.POINTER(ctypes.c_int)), ("names", ctypes.POINTER(ctypes.POINTER(_ByteSpan))),
                ("attrs", ctypes.POINTER(_P))]


class _ErrorCreateArgs(ctypes.Structure):
    _fields_ = [("struct_size", _SIZE), ("extension_start", _P), ("message", ctypes.c_char_p),
                ("errc", ctypes.c_int)]


class _StreamGetArgs(ctypes.Structure):
    _fields_ = [("struct_size", _SIZE), ("extension_start", _P), ("ctx", _P), ("stream", _P)]


class _Api(ctypes.Structure):  # the first entries of XLA_FFI_Api, in order
    _fields_ = [("struct_size", _SIZE), ("extension_start", _P), ("api_version", _ApiVersion), ("internal_api", _P),
                ("error_create", ctypes.CFUNCTYPE(_P, ctypes.POINTER(_ErrorCreateArgs))),
                ("error_get_message", _P), ("error_destroy", _P), ("handler_register", _P),
                ("stream_get", ctypes.CFUNCTYPE(_P, ctypes.POINTER(_StreamGetArgs)))]


class CallFrame(ctypes.Structure):
    """XLA_FFI_CallFrame: what a handler is called with."""
    _fields_ = [("struct_size", _SIZE), ("extension_start", ctypes.POINTER(_ExtensionBase)),
                ("api", ctypes.POINTER(_Api)), ("ctx", _P), ("stage", ctypes.c_int), ("args", _List),
                ("rets", _List), ("attrs", _Attrs), ("future", _P)]


class ErrorCode(enum.IntEnum):
    """XLA_FFI_Error_Code values moecomm reports with."""
    INVALID_ARGUMENT = 3
    INTERNAL = 13


# XLA_FFI_DataType -> numpy dtype, for the dtypes moecomm's arrays may have
DTYPES = {4: np.dtype(np.int32), 8: np.dtype(np.uint32), 5: np.dtype(np.int64), 6: np.dtype(np.uint8),
          10: np.dtype(np.float16), 11: np.dtype(np.float32), 16: np.dtype(bfloat16), 20: np.dtype(float8_e4m3fn),
          33: np.dtype(float8_e8m0fnu)}
EXECUTE = 3  # XLA_FFI_ExecutionStage_EXECUTE: the stage that runs the operation (the others prepare it)

HANDLER = ctypes.CFUNCTYPE(_P, ctypes.POINTER(CallFrame))


def handler(fn, graphs):
    """A C function pointer XLA can call, running ``fn(frame)`` (frame: the CallFrame) at the execute stage;
    ``graphs``: say the handler may be traced into command buffers. An exception ``fn`` raises becomes an
    XLA error carrying its text (``fn``'s own record of it is for the caller to keep)."""
    def call(frame_ptr):
        frame = frame_ptr.contents
        ext = frame.extension_start
        if ext and ext.contents.type == _METADATA_EXTENSION:  # XLA asks for the version and the traits
            meta = ctypes.cast(ext, ctypes.POINTER(_MetadataExtension)).contents.metadata.contents
            meta.api_version.major_version, meta.api_version.minor_version = 0, 1
            meta.traits = COMMAND_BUFFER_COMPATIBLE if graphs else 0
            return None
        if frame.stage != EXECUTE:
            return None
        try:
            fn(frame)
        except Exception as e:  # noqa: BLE001 - every failure goes back to XLA as an error with its text
            code = ErrorCode.INVALID_ARGUMENT if isinstance(e, ValueError) else ErrorCode.INTERNAL
            args = _ErrorCreateArgs(ctypes.sizeof(_ErrorCreateArgs), None,
                                    f"{type(e).__name__}: {e}".encode(errors="replace"), int(code))
            return frame.api.contents.error_create(ctypes.byref(args))
        return None
    return HANDLER(call)


def stream(frame):
    """The CUDA stream (a handle) XLA runs the call on."""
    args = _StreamGetArgs(ctypes.sizeof(_StreamGetArgs), None, frame.ctx, None)
    frame.api.contents.stream_get(ctypes.byref(args))
    return args.stream or 0


def buffers(items):
    """The frame's arguments or results (frame.args / frame.rets) as a list of (address, shape, dtype)."""
    out = []
    for i in range(items.size):
        b = items.items[i].contents
        out.append((b.data or 0, tuple(b.dims[j] for j in range(b.rank)), DTYPES.get(b.dtype)))
    return out


_SCALAR = 3  # XLA_FFI_AttrType_SCALAR
_S64 = 5     # XLA_FFI_DataType_S64


def int_attr(frame, name):
    """The value of the frame's attribute ``name`` (str), an int64 scalar; KeyError where it has none."""
    key = name.encode()
    for i in range(frame.attrs.size):
        span = frame.attrs.names[i].contents
        if ctypes.string_at(span.ptr, span.len) != key:
            continue
        scalar = ctypes.cast(frame.attrs.attrs[i], ctypes.POINTER(_Scalar)).contents
        if frame.attrs.types[i] != _SCALAR or scalar.dtype != _S64:
            raise TypeError(f"XLA FFI attribute {name!r}: not an int64 scalar")
        return ctypes.cast(scalar.value, ctypes.POINTER(ctypes.c_int64)).contents.value
    raise KeyError(f"XLA FFI call frame: no attribute {name!r}")
