"""Device-array interop parsed without a GPU: __cuda_array_interface__, DLPack capsules, raw pointers."""
import numpy as np
import pytest

import moecomm
from moecomm import _arrays


class FakeCAI:
    def __init__(self, shape, typestr, strides=None, ptr=0x7000_0000):
        self.__cuda_array_interface__ = dict(shape=shape, typestr=typestr, data=(ptr, False),
                                             strides=strides, version=3)


def test_cai_accepts_and_checks():
    b = _arrays.device_array(FakeCAI((4, 8), "<f2"), "x", np.float16, (4, 8), device=-1)
    assert (b.ptr, b.shape, b.nbytes) == (0x7000_0000, (4, 8), 64)
    # bfloat16 arriving as a raw 2-byte type is accepted and described as bfloat16
    b = _arrays.device_array(FakeCAI((4, 8), "<V2"), "x", moecomm.bfloat16, (4, None), device=-1)
    assert b.dtype == moecomm.bfloat16
    with pytest.raises(moecomm.InvalidArgument, match="dtype float32 does not match expected float16"):
        _arrays.device_array(FakeCAI((4, 8), "<f4"), "x", np.float16, (4, 8), device=-1)
    with pytest.raises(moecomm.InvalidArgument, match=r"shape \(4, 8\) does not match expected \(4, 16\)"):
        _arrays.device_array(FakeCAI((4, 8), "<f2"), "x", np.float16, (4, 16), device=-1)
    with pytest.raises(moecomm.InvalidArgument, match="C-contiguous"):
        _arrays.device_array(FakeCAI((4, 8), "<f2", strides=(2, 8)), "x", np.float16, (4, 8), device=-1)
    # C strides given explicitly are fine
    _arrays.device_array(FakeCAI((4, 8), "<f2", strides=(16, 2)), "x", np.float16, (4, 8), device=-1)


def test_dlpack_parsed_and_host_memory_refused():
    a = np.zeros((3, 5), np.float32)
    with pytest.raises(moecomm.InvalidArgument, match="got ndarray"):
        _arrays.device_array(a, "x", np.float32, (3, 5), device=-1)

    class Wrapper:  # a non-numpy producer of a CPU DLPack capsule
        def __dlpack__(self, **kw):
            return a.__dlpack__()
    with pytest.raises(moecomm.InvalidArgument, match="not CUDA memory"):
        _arrays.device_array(Wrapper(), "x", np.float32, (3, 5), device=-1)


def test_raw_pointer_layer():
    b = moecomm.DeviceBuffer(0x1234_0000, (2, 16), moecomm.float8_e4m3fn)
    got = _arrays.device_array(b, "x", moecomm.float8_e4m3fn, (2, 16), device=-1)
    assert got.ptr == 0x1234_0000 and got.nbytes == 32
    with pytest.raises(moecomm.InvalidArgument, match="expected a device array"):
        _arrays.device_array([1, 2], "x", np.float32, (2,), device=-1)
