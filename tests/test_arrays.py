"""The device-array edge without a GPU: every reader (DeviceBuffer, tensor-like, DLPack, CUDA array
interface), stream ordering with producers, producer errors, and every bad argument of dispatch and
combine through the device path, named in an InvalidArgument (a fake device transport stands in for
the GPU, as tinygrad's fake driver does)."""
import contextlib
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

import moecomm
from moecomm import _abi, _arrays
from moecomm import _constants as C
from moecomm._constants import ARGUMENTS, HALVES
from moecomm.comm import OneCall
from moecomm.transport.base import AllToAllBackend, Transport

LAUNCH = 0x100  # the launch stream of these tests


class FakeOrder:
    """Records the stream waits DeviceArrays asks for."""
    def __init__(self):
        self.waits = []

    def after(self, producer, consumer):
        self.waits.append((producer, consumer))

    def destroy(self):
        pass



def device_arrays(memory=None):
    """DeviceArrays for device 0 whose pointer lookups come from ``memory`` ({ptr: device or None})."""
    order = FakeOrder()
    arrays = _arrays.DeviceArrays(0, order, lambda ptr: (memory or {}).get(ptr, 0), 16)
    arrays._framework_stream = lambda which: {"torch": 0x700, "cupy": 0x800}[which]
    arrays.begin(LAUNCH, None)
    return arrays, order


class FakeCAI:
    def __init__(self, shape, typestr, strides=None, ptr=0x7000_0000, stream=None):
        self._cai = dict(shape=shape, typestr=typestr, data=(ptr, False), strides=strides, version=3, stream=stream)

    @property
    def __cuda_array_interface__(self):
        return self._cai


class FakeDtype:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return f"torch.{self.name}"


_TORCH_DTYPES = {n: FakeDtype(n) for n in ("bfloat16", "float16", "float8_e4m3fn", "float32", "int32",
                                           "uint32", "int64", "complex64")}


class FakeTensor:
    """What the tensor reader uses of a torch.Tensor: data_ptr(), shape, dtype, is_contiguous(),
    get_device() (-1 for CPU tensors)."""
    def __init__(self, shape, dtype, ptr=0x7100_0000, contiguous=True, device=0):
        self.shape, self.dtype, self._ptr = tuple(shape), _TORCH_DTYPES[dtype], ptr
        self._c, self._dev = contiguous, device

    def data_ptr(self):
        return self._ptr

    def is_contiguous(self):
        return self._c

    def get_device(self):
        return self._dev


def read(obj, want, shape, arrays=None):
    arrays = arrays or device_arrays()[0]
    return arrays.read(obj, "x", _arrays.accepted(want), shape)


def test_cai_accepts_and_checks():
    assert read(FakeCAI((4, 8), "<f2"), np.float16, (4, 8)) == 0x7000_0000
    # bfloat16 arriving as a raw 2-byte type is accepted and read as bfloat16
    arrays = device_arrays()[0]
    read(FakeCAI((4, 8), "<V2"), moecomm.bfloat16, (None, 8), arrays)
    assert arrays.dtype == moecomm.bfloat16
    with pytest.raises(moecomm.InvalidArgument, match="x: dtype float32 does not match expected float16"):
        read(FakeCAI((4, 8), "<f4"), np.float16, (4, 8))
    with pytest.raises(moecomm.InvalidArgument, match=r"x: shape \(4, 8\) does not match expected \(4, 16\)"):
        read(FakeCAI((4, 8), "<f2"), np.float16, (4, 16))
    with pytest.raises(moecomm.InvalidArgument, match="x: must be C-contiguous"):
        read(FakeCAI((4, 8), "<f2", strides=(2, 8)), np.float16, (4, 8))
    read(FakeCAI((4, 8), "<f2", strides=(16, 2)), np.float16, (4, 8))  # C strides given explicitly
    with pytest.raises(moecomm.InvalidArgument, match="16-byte aligned"):
        read(FakeCAI((4, 8), "<f2", ptr=0x7000_0008), np.float16, (4, 8))


def test_rows_are_the_fewest_of_the_per_token_arrays_and_at_most_max_rows():
    """Per-token arrays (an expected shape starting with None) count their rows: ``rows`` is the fewest since
    begin(), each at most max_rows (16 here); fixed shapes count nothing."""
    arrays, _ = device_arrays()
    assert arrays.rows == 16
    read(FakeCAI((12, 8), "<f2"), np.float16, (None, 8), arrays)
    read(FakeCAI((9, 8), "<f2"), np.float16, (None, 8), arrays)
    read(FakeCAI((4, 8), "<f2"), np.float16, (4, 8), arrays)
    assert arrays.rows == 9
    with pytest.raises(moecomm.InvalidArgument, match=r"x: expected at most max_num_tokens=16 rows, got shape"):
        read(FakeCAI((17, 8), "<f2"), np.float16, (None, 8), arrays)
    arrays.begin(LAUNCH, None)
    assert arrays.rows == 16


def test_cai_stream_is_waited_for():
    arrays, order = device_arrays()
    arrays.read(FakeCAI((2,), "<i4", stream=0x555), "a", _arrays.accepted(np.int32), (2,))
    arrays.read(FakeCAI((2,), "<i4", stream=LAUNCH), "b", _arrays.accepted(np.int32), (2,))
    arrays.read(FakeCAI((2,), "<i4", stream=None), "c", _arrays.accepted(np.int32), (2,))
    arrays.order()
    assert order.waits == [(0x555, LAUNCH)]  # the launch stream itself and "no sync needed" wait for nothing
    arrays.begin(LAUNCH, None)
    arrays.read(FakeCAI((2,), "<i4", stream=1), "d", _arrays.accepted(np.int32), (2,))
    arrays.order()
    assert order.waits[-1] == (0, LAUNCH)  # CAI's 1 is the legacy default stream


def test_memory_elsewhere_is_refused():
    arrays, _ = device_arrays({0x7000_0000: 1, 0x7200_0000: None})
    with pytest.raises(moecomm.InvalidArgument, match="x: memory is on device 1, expected device 0"):
        read(FakeCAI((2,), "<i4"), np.int32, (2,), arrays)
    with pytest.raises(moecomm.InvalidArgument, match="x: memory at 0x72000000 is not device memory"):
        read(FakeCAI((2,), "<i4", ptr=0x7200_0000), np.int32, (2,), arrays)


@pytest.mark.parametrize("dtype,want", [("bfloat16", moecomm.bfloat16), ("float16", moecomm.float16),
                                        ("float8_e4m3fn", moecomm.float8_e4m3fn), ("float32", np.float32),
                                        ("int32", np.int32), ("uint32", np.uint32), ("int64", np.int64)])
def test_tensor_dtypes(dtype, want):
    arrays, order = device_arrays()
    ptr = arrays.read(FakeTensor((3, 16), dtype), "x", _arrays.accepted(want), (3, 16))
    assert (ptr, arrays.dtype) == (0x7100_0000, np.dtype(want))
    arrays.order()
    assert order.waits == [(0x700, LAUNCH)]  # written on torch's current stream, not the launch stream


def test_tensor_refusals():
    with pytest.raises(moecomm.InvalidArgument, match="x: dtype unknown does not match expected bfloat16"):
        read(FakeTensor((2, 8), "complex64"), moecomm.bfloat16, (2, 8))
    with pytest.raises(moecomm.InvalidArgument, match="x: dtype int64 does not match expected int32"):
        read(FakeTensor((2, 8), "int64"), np.int32, (2, 8))
    with pytest.raises(moecomm.InvalidArgument, match="x: must be C-contiguous"):
        read(FakeTensor((2, 8), "int32", contiguous=False), np.int32, (2, 8))
    with pytest.raises(moecomm.InvalidArgument, match="x: memory is on device 3, expected device 0"):
        read(FakeTensor((2, 8), "int32", device=3), np.int32, (2, 8))
    cpu = device_arrays({0x7100_0000: None})[0]  # a CPU tensor: get_device() is -1, the pointer is host memory
    with pytest.raises(moecomm.InvalidArgument, match="is not device memory"):
        read(FakeTensor((2, 8), "int32", device=-1), np.int32, (2, 8), cpu)


def test_producer_errors_name_the_argument():
    class Raising:
        @property
        def __cuda_array_interface__(self):
            raise KeyError("bfloat16 is not supported by the CUDA array interface")

    with pytest.raises(moecomm.InvalidArgument, match=r"x: could not read the Raising \(KeyError: "):
        read(Raising(), np.int32, (2,))

    class BadTensor(FakeTensor):
        def data_ptr(self):
            raise RuntimeError("tensor storage was freed")

    with pytest.raises(moecomm.InvalidArgument, match="x: could not read the BadTensor .*storage was freed"):
        read(BadTensor((2,), "int32"), np.int32, (2,))


def test_dlpack_gets_the_launch_stream_and_host_memory_is_refused():
    a = np.zeros((3, 5), np.float32)
    with pytest.raises(moecomm.InvalidArgument, match="x: expected a device array .* got ndarray"):
        read(a, np.float32, (3, 5))
    seen = []

    class Producer:  # a non-numpy producer of a CPU DLPack capsule
        def __dlpack__(self, stream=None):
            seen.append(stream)
            return a.__dlpack__()

    with pytest.raises(moecomm.InvalidArgument, match="x: DLPack device type 1 is not CUDA memory"):
        read(Producer(), np.float32, (3, 5))
    arrays, _ = device_arrays()
    arrays.begin(0, None)  # the legacy default stream is 1 in DLPack
    with pytest.raises(moecomm.InvalidArgument):
        arrays.read(Producer(), "x", _arrays.accepted(np.float32), (3, 5))
    assert seen == [LAUNCH, 1]


def test_raw_pointer_layer():
    b = moecomm.DeviceBuffer(0x1234_0000, (2, 16), moecomm.float8_e4m3fn)
    assert read(b, moecomm.float8_e4m3fn, (2, 16)) == 0x1234_0000
    assert b.nbytes == 32
    with pytest.raises(moecomm.InvalidArgument, match="x: expected a device array .* got list"):
        read([1, 2], np.float32, (2,))
    # normalised at construction (a shape of numpy integers, a dtype by name), frozen, compared by value
    c = moecomm.DeviceBuffer(0x1234_0000, [np.int64(2), 16], "float32", device=0)
    assert (c.shape, type(c.shape[1]), c.dtype, c.owner) == ((2, 16), int, np.dtype(np.float32), None)
    assert c == moecomm.DeviceBuffer(0x1234_0000, (2, 16), np.float32, 0)
    assert dataclasses.replace(c, ptr=0x1235_0000).ptr == 0x1235_0000
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.ptr = 0


# --- AllToAll through the device path, on a fake GPU transport ---------------------------------

E, K, H, S, M = 8, 2, 256, 2, 16


class FakeBackend(AllToAllBackend):
    def __init__(self):
        self.calls, self.launches = {"dispatch": _abi.Call(), "combine": _abi.Call()}, []

    def records(self):
        return self.calls

    def dispatch(self, record, do_send, do_recv, stream, sources=None):
        assert record is self.calls["dispatch"]  # AllToAll hands over the record it filled: this backend's
        self.launches.append(("dispatch", do_send, do_recv, stream, bytes(record)))

    def combine(self, record, do_send, do_recv, stream):
        assert record is self.calls["combine"]
        self.launches.append(("combine", do_send, do_recv, stream, bytes(record)))

    def skip(self, halves, stream, refusal=None):
        self.launches.append(("skip", halves, refusal.code if refusal else 0, stream))

    def set_mask(self, masked, generation, barrier):
        pass

    def snapshot(self):
        return {}

    def destroy(self, collective):
        pass


class FakeTransport(Transport):
    name, memory, device = "fake", "device", 0

    def new_alltoall(self, cfg, timeout_s, ident):
        self.backend = FakeBackend()
        return self.backend

    def new_arrays(self, max_rows):
        return device_arrays()[0]

    def check_peers(self, nbytes, timeout_s):
        pass

    def finalize(self, collective):
        pass


@pytest.fixture
def fake():
    comm = SimpleNamespace(world_size=1, rank=0, timeout_s=1.0, transport=FakeTransport(), broken=None, breaks=0,
                           allgather=lambda obj, what: [obj], breaking=contextlib.nullcontext, calls=OneCall(0),
                           register=lambda a: 1, unregister=lambda a: None, fail=lambda e: None)
    return moecomm.AllToAll(comm, M, E, K, H, S, "float8_e4m3fn", "bfloat16")


def _buffers():
    """Good dispatch arguments: tensors, CUDA-array-interface objects and raw buffers, at distinct addresses."""
    return dict(
        out_expert_num_tokens=FakeTensor((E,), "int32", ptr=0x1000),
        out_expert_x=moecomm.DeviceBuffer(0x2000, (E, M, H), moecomm.float8_e4m3fn, 0),
        out_expert_x_scale=FakeCAI((E, M, S), "<f4", ptr=0x3000),
        dp_x=FakeTensor((M, H), "float8_e4m3fn", ptr=0x4000),
        dp_x_scale=FakeTensor((M, S), "float32", ptr=0x5000),
        indices=FakeTensor((M, K), "int64", ptr=0x6000),
        bound_m=FakeTensor((1,), "uint32", ptr=0x7000),
        weights=FakeTensor((M, K), "float32", ptr=0x8000))


BAD = {
    "out_expert_num_tokens": FakeTensor((E,), "int64", ptr=0x1000),
    "out_expert_x": moecomm.DeviceBuffer(0x2000, (E, M, H + 16), moecomm.float8_e4m3fn, 0),
    "out_expert_x_scale": FakeCAI((E, M, S), "<f4", ptr=0x3008),
    "dp_x": FakeTensor((M, H), "bfloat16", ptr=0x4000),
    "dp_x_scale": FakeTensor((M, S), "float32", ptr=0x5000, contiguous=False),
    "indices": FakeTensor((M, K + 1), "int64", ptr=0x6000),
    "bound_m": FakeTensor((1,), "int64", ptr=0x7000),
    "weights": FakeTensor((M, K), "float32", ptr=0x8000, device=1),
}


def refused(arg):
    """The reason a skipped call's signals carry for a refused argument."""
    return C.ERR_REFUSED | ARGUMENTS.index(arg) << C.REASON_ARG_SHIFT


@pytest.mark.parametrize("arg", list(BAD))
def test_bad_dispatch_argument_is_named_and_nothing_launches(fake, arg):
    with pytest.raises(moecomm.InvalidArgument, match=f"^{arg}: "):
        fake.dispatch(**dict(_buffers(), **{arg: BAD[arg]}), stream=LAUNCH)
    launches = fake.comm.transport.backend.launches
    # the refused call is run with no data, the argument named by its number, on the call's stream
    assert launches == [("skip", HALVES, refused(arg), LAUNCH)]
    fake.dispatch(**_buffers(), stream=LAUNCH)  # the next good call goes through
    assert launches[-1][3] == LAUNCH
    call = _abi.Call.from_buffer_copy(launches[-1][4])
    assert (call.x, call.x_scale, call.indices, call.idx64, call.bound_m, call.weights, call.out_num, call.out_x,
            call.out_scale, call.rows) == (0x4000, 0x5000, 0x6000, 1, 0x7000, 0x8000, 0x1000, 0x2000, 0x3000, M)


BAD_COMBINE = {
    "out_tokens": FakeTensor((M, H), "float16", ptr=0x9000),
    "indices": FakeTensor((M - 1, K + 1), "int32", ptr=0x6000),
    "weights": FakeTensor((M, K), "bfloat16", ptr=0x8000),
    "expert_y": moecomm.DeviceBuffer(0xa000, (E, M, H), moecomm.float8_e4m3fn, 0),
    "bound_m": FakeCAI((2,), "<i4", ptr=0x7000),
}


@pytest.mark.parametrize("arg", list(BAD_COMBINE))
def test_bad_combine_argument_is_named(fake, arg):
    fake.dispatch(**_buffers(), stream=LAUNCH)
    good = dict(out_tokens=FakeTensor((M, H), "bfloat16", ptr=0x9000), indices=FakeTensor((M, K), "int32", ptr=0x6000),
                weights=FakeTensor((M, K), "float32", ptr=0x8000),
                expert_y=moecomm.DeviceBuffer(0xa000, (E, M, H), moecomm.bfloat16, 0),
                bound_m=FakeTensor((1,), "int32", ptr=0x7000))
    with pytest.raises(moecomm.InvalidArgument, match=f"^{arg}: "):
        fake.combine(**dict(good, **{arg: BAD_COMBINE[arg]}), stream=LAUNCH)
    assert fake.comm.transport.backend.launches[-1] == ("skip", HALVES[2:], refused(arg), LAUNCH)
    fake.dispatch(**_buffers(), stream=LAUNCH)  # the refused combine ended the call
    fake.combine(**good, stream=LAUNCH)
    call = _abi.Call.from_buffer_copy(fake.comm.transport.backend.launches[-1][4])
    assert (call.out_tokens, call.y, call.idx64, call.partials, call.rows) == (0x9000, 0xa000, 0, 0, M)


def test_stream_none_follows_the_first_array(fake):
    fake.dispatch(**_buffers())  # dp_x is a tensor: torch's current stream
    assert fake.comm.transport.backend.launches[-1][3] == 0x700


def test_out_dropped_reaches_the_call_record(fake):
    """out_dropped (capacity policies) goes into the call record as an address."""
    fake.dispatch(**_buffers(), stream=LAUNCH)
    good = dict(out_tokens=FakeTensor((M, H), "bfloat16", ptr=0x9000), indices=FakeTensor((M, K), "int32", ptr=0x6000),
                weights=FakeTensor((M, K), "float32", ptr=0x8000),
                expert_y=moecomm.DeviceBuffer(0xa000, (E, M, H), moecomm.bfloat16, 0),
                bound_m=FakeTensor((1,), "int32", ptr=0x7000))
    fake.combine(**good, stream=LAUNCH, out_dropped=moecomm.DeviceBuffer(0xb000, (M, K), np.uint8, 0))
    record = _abi.Call.from_buffer_copy(fake.comm.transport.backend.launches[-1][4])
    assert record.out_dropped == 0xb000


def _device_buffers(**changed):
    """A call of only DeviceBuffers (dispatch, combine), ``changed`` replacing some of dispatch's."""
    B = moecomm.DeviceBuffer
    dispatch = dict(out_expert_num_tokens=B(0x1000, (E,), np.int32, 0),
                    out_expert_x=B(0x2000, (E, M, H), moecomm.float8_e4m3fn, 0),
                    out_expert_x_scale=B(0x3000, (E, M, S), np.float32, 0),
                    dp_x=B(0x4000, (M, H), moecomm.float8_e4m3fn, 0), dp_x_scale=B(0x5000, (M, S), np.float32, 0),
                    indices=B(0x6000, (M, K), np.int64, 0), bound_m=B(0x7000, (1,), np.int32, 0),
                    weights=B(0x8000, (M, K), np.float32, 0))
    combine = dict(out_tokens=B(0x9000, (M, H), moecomm.bfloat16, 0), indices=B(0x6100, (M - 1, K), np.int32, 0),
                   weights=None, expert_y=B(0xa000, (E, M, H), moecomm.bfloat16, 0), bound_m=dispatch["bound_m"])
    return dict(dispatch, **changed), combine


def _launched(fake, phase):
    """The call record of the last launch of ``phase``."""
    last = next(lc for lc in reversed(fake.comm.transport.backend.launches) if lc[0] == phase)
    return _abi.Call.from_buffer_copy(last[4])


def _dispatched(call):
    return (call.x, call.x_scale, call.indices, call.idx64, call.bound_m, call.weights, call.out_num, call.out_x,
            call.out_scale, call.rows)


def test_the_same_device_buffers_find_their_record_as_they_left_it(fake):
    """A call given the same DeviceBuffers as its phase's last is not read again (AllToAll._read): the
    kernels still get its arrays after the other phase, other arrays and a refused call ran between."""
    d, c = _device_buffers()
    want_d = (0x4000, 0x5000, 0x6000, 1, 0x7000, 0x8000, 0x1000, 0x2000, 0x3000, M)
    want_c = (0x9000, 0xa000, 0x6100, 0, 1, M - 1)

    def combined():
        call = _launched(fake, "combine")
        return call.out_tokens, call.y, call.indices, call.idx64, call.partials, call.rows

    for _ in range(2):
        fake.dispatch(**d, stream=LAUNCH)
        assert _dispatched(_launched(fake, "dispatch")) == want_d
        fake.combine(**c, stream=LAUNCH)
        assert combined() == want_c
    other, _ = _device_buffers(out_expert_x=moecomm.DeviceBuffer(0x2800, (E, M, H), moecomm.float8_e4m3fn, 0),
                               indices=moecomm.DeviceBuffer(0x6800, (M - 2, K), np.int32, 0))
    fake.dispatch(**other, stream=LAUNCH)
    assert _dispatched(_launched(fake, "dispatch")) == (0x4000, 0x5000, 0x6800, 0, 0x7000, 0x8000, 0x1000, 0x2800,
                                                      0x3000, M - 2)
    fake.combine(**c, stream=LAUNCH)
    assert combined() == want_c
    fake.dispatch(**d, stream=LAUNCH)
    fake.combine(**c, stream=LAUNCH)
    bad, _ = _device_buffers(dp_x=moecomm.DeviceBuffer(0x4800, (M, H), moecomm.float8_e4m3fn, 0),
                             dp_x_scale=moecomm.DeviceBuffer(0x5000, (M, S + 1), np.float32, 0))
    with pytest.raises(moecomm.InvalidArgument, match="^dp_x_scale: "):  # refused after dp_x was read
        fake.dispatch(**bad, stream=LAUNCH)
    fake.dispatch(**d, stream=LAUNCH)
    assert _dispatched(_launched(fake, "dispatch")) == want_d
    fake.combine(**c, stream=LAUNCH)


def test_the_call_order_rules_hold_for_device_buffers_seen_before(fake):
    """The checks that depend on the call order run for a call whose arrays were not read again."""
    d, c = _device_buffers()
    fake.dispatch(**d, stream=LAUNCH)
    fake.combine(**c, stream=LAUNCH)
    fake.dispatch(**d, do_recv=False, stream=LAUNCH)
    moved, _ = _device_buffers(out_expert_x=moecomm.DeviceBuffer(0x2800, (E, M, H), moecomm.float8_e4m3fn, 0))
    with pytest.raises(moecomm.InvalidArgument, match="receive half got other output arrays"):
        fake.dispatch(**moved, do_send=False, stream=LAUNCH)  # refused: it ends that call
    fake.dispatch(**d, do_recv=False, stream=LAUNCH)
    fake.dispatch(**d, do_send=False, stream=LAUNCH)  # the receive half with the send half's outputs
    fake.combine(**dict(c, weights=d["weights"]), stream=LAUNCH)
    unweighted = dict(d, weights=None)
    fake.dispatch(**unweighted, stream=LAUNCH)
    with pytest.raises(moecomm.InvalidArgument, match="weights=None needs the router weights"):
        fake.combine(**c, stream=LAUNCH)
    fake.dispatch(**d, stream=LAUNCH)
    fake.combine(**c, stream=LAUNCH)
    assert _dispatched(_launched(fake, "dispatch"))[5] == 0x8000


def _tensors():
    """A dispatch and a combine of torch-like tensors and one DeviceBuffer (for prepared calls)."""
    d = dict(out_expert_num_tokens=FakeTensor((E,), "int32", ptr=0x1000),
             out_expert_x=moecomm.DeviceBuffer(0x2000, (E, M, H), moecomm.float8_e4m3fn, 0),
             out_expert_x_scale=FakeTensor((E, M, S), "float32", ptr=0x3000),
             dp_x=FakeTensor((M, H), "float8_e4m3fn", ptr=0x4000), dp_x_scale=FakeTensor((M, S), "float32", ptr=0x5000),
             indices=FakeTensor((M, K), "int64", ptr=0x6000), bound_m=FakeTensor((1,), "int32", ptr=0x7000),
             weights=FakeTensor((M, K), "float32", ptr=0x8000))
    c = dict(out_tokens=FakeTensor((M, H), "bfloat16", ptr=0x9000), indices=d["indices"], weights=None,
             expert_y=FakeTensor((E, M, H), "bfloat16", ptr=0xa000), bound_m=d["bound_m"])
    return d, c


def _counting_reads(fake):
    """Count the arguments fake's AllToAll reads (a list, one name per read)."""
    names, read = [], fake._arrays.read

    def counted(obj, name, *rest, **kw):
        names.append(name)
        return read(obj, name, *rest, **kw)
    fake._arrays.read = counted
    return names


def test_prepared_calls_read_their_arrays_once_and_check_them_after(fake):
    """A prepared dispatch and combine read and check their tensors at the first run only; later runs fill the
    same call records, with the producers' stream still waited for (torch's current stream, 0x700, before the
    launch stream)."""
    d, c = _tensors()
    dispatch, combine = fake.prepare_dispatch(**d, stream=LAUNCH), fake.prepare_combine(**c, stream=LAUNCH)
    names = _counting_reads(fake)
    order = fake._arrays._order
    want_d = (0x4000, 0x5000, 0x6000, 1, 0x7000, 0x8000, 0x1000, 0x2000, 0x3000, M)
    for step in range(3):
        dispatch()
        assert _dispatched(_launched(fake, "dispatch")) == want_d
        assert order.waits[-1] == (0x700, LAUNCH)
        combine(do_send=True, do_recv=False)
        combine(do_send=False, do_recv=True)
        assert (_launched(fake, "combine").out_tokens, _launched(fake, "combine").partials) == (0x9000, 1)
        if step == 0:
            read_once = len(names)
    assert read_once == 12 and len(names) == read_once  # 8 of dispatch (no offsets), 4 of combine (no weights)


@pytest.mark.parametrize("change", ["address", "shape", "dtype", "layout"])
def test_a_prepared_call_whose_array_changed_is_refused_then_read_again(fake, change):
    """An array of a prepared call that changed in place (address, shape, dtype, contiguity) is refused with
    InvalidArgument naming it, the call taking part with no data (the peers raise PeerError); the next run
    reads the arrays again and uses what they are now."""
    d, c = _tensors()
    dispatch, combine = fake.prepare_dispatch(**d, stream=LAUNCH), fake.prepare_combine(**c, stream=LAUNCH)
    dispatch()
    combine()
    x = d["dp_x"]
    if change == "address":
        x._ptr = 0x4800
    elif change == "shape":
        x.shape = (M - 1, H)
    elif change == "dtype":
        x.dtype = _TORCH_DTYPES["float16"]
    else:
        x._c = False
    with pytest.raises(moecomm.InvalidArgument, match="^dp_x: its address, shape, dtype or layout changed"):
        dispatch()
    assert fake.comm.transport.backend.launches[-1] == ("skip", HALVES, refused("dp_x"), LAUNCH)
    if change == "address":
        dispatch()
        assert _launched(fake, "dispatch").x == 0x4800
        combine()
    elif change == "shape":
        dispatch()
        assert _launched(fake, "dispatch").rows == M - 1
        combine()
    else:  # now a bad argument: refused by reading it
        with pytest.raises(moecomm.InvalidArgument, match="^dp_x: "):
            dispatch()


def test_prepared_calls_of_other_kinds_read_them_every_time(fake):
    """A prepared call with an array only reading tells about (__cuda_array_interface__, DLPack) reads its
    arrays every run (correct, not faster)."""
    d, c = _tensors()
    d["out_expert_x_scale"] = FakeCAI((E, M, S), "<f4", ptr=0x3000)
    dispatch = fake.prepare_dispatch(**d, stream=LAUNCH)
    names = _counting_reads(fake)
    for _ in range(2):
        dispatch()
        fake.combine(**c, stream=LAUNCH)
    assert names.count("dp_x") == 2


def test_torch_tensors_are_read_with_torch_function_modes_off(fake):
    """Under a torch function mode (torch.set_default_device's, which DeepEP's tests and some engines set) reading
    a call's torch tensors reaches no mode: each tensor method would otherwise go through it (~1 µs each)."""
    torch = pytest.importorskip("torch")
    from torch.overrides import TorchFunctionMode

    class Counting(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    d = dict(out_expert_num_tokens=torch.zeros(E, dtype=torch.int32),
             out_expert_x=moecomm.DeviceBuffer(0x2000, (E, M, H), moecomm.float8_e4m3fn, 0),
             out_expert_x_scale=torch.zeros((E, M, S)), dp_x=torch.zeros((M, H), dtype=torch.float8_e4m3fn),
             dp_x_scale=torch.zeros((M, S)), indices=torch.zeros((M, K), dtype=torch.int64),
             bound_m=torch.full((1,), M, dtype=torch.int32), weights=torch.zeros((M, K)))
    out, expert_y = torch.zeros((M, H), dtype=torch.bfloat16), torch.zeros((E, M, H), dtype=torch.bfloat16)
    with Counting() as mode:
        fake.dispatch(**d, stream=LAUNCH)
        fake.combine(out, d["indices"], None, expert_y, d["bound_m"], stream=LAUNCH)
    assert [launch[0] for launch in fake.comm.transport.backend.launches] == ["dispatch", "combine"]
    assert mode.calls == 0
