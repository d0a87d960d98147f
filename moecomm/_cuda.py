"""The CUDA driver through cuda.bindings: one checking helper, the rank's context, modules, launches.

Every driver call of moecomm goes through :func:`check`, but those that every call makes: the kernel
launch (:class:`Launch`), the capture query before a programmatic one, and the context query and switch,
through CuPy's driver and runtime modules, whose entry points take and return plain ints where cuda.bindings
converts each argument and result to its own types; a launch into a CUDA graph being captured goes through
``cuLaunchKernelEx`` itself (ctypes, its configuration built once), the launch that takes attributes. Device work
runs in the primary context of the rank's GPU (the one CuPy and NVSHMEM use): entry points make it
current for their duration and give the caller's context back (:meth:`Context.enter` /
:meth:`Context.leave`), so a caller whose current device is another GPU (JAX moves it to the GPU it last
touched) neither breaks a call nor sees it changed.
"""
import ctypes
import functools

from cuda.bindings import driver
from cupy.cuda import driver as per_call
from cupy.cuda import runtime as per_call_runtime

from ._errors import CompileError, MoeCommError

NO_CONTEXT = 0  # what Context.enter returns when no context was current
_DEVICE_MEMORY = (int(driver.CUmemorytype.CU_MEMORYTYPE_DEVICE), int(driver.CUmemorytype.CU_MEMORYTYPE_UNIFIED))


def check(result, what):
    """Raise MoeCommError naming ``what`` unless a cuda.bindings call succeeded; return its value(s)."""
    if result[0]:
        raise error(result[0], what)
    return result[1] if len(result) == 2 else result[1:] or None


def error(code, what):
    name = driver.cuGetErrorName(code)[1]
    return MoeCommError(f"{what} failed: {name.decode() if name else int(code)}")


def _per_call_error(e, what):
    """MoeCommError naming ``what`` from the CUDADriverError of a per-call entry point."""
    return MoeCommError(f"{what} failed: {e}")


class Context:
    """The primary context of CUDA device ``device``, retained for the life of this object."""

    def __init__(self, device):
        check(driver.cuInit(0), "cuInit")
        self.device = device
        self._dev = check(driver.cuDeviceGet(device), "cuDeviceGet")
        self.handle = check(driver.cuDevicePrimaryCtxRetain(self._dev), "cuDevicePrimaryCtxRetain")
        self._address = int(self.handle)

    def enter(self):
        """Make this context current. Returns what :meth:`leave` needs to give the caller's back (None
        when it already was current: the common case, one driver query; NO_CONTEXT when none was)."""
        try:
            current = per_call.ctxGetCurrent()
            if current == self._address:
                return None
            per_call.ctxSetCurrent(self._address)
        except per_call.CUDADriverError as e:
            raise _per_call_error(e, "making the rank's context current") from None
        return current

    @staticmethod
    def leave(previous):
        if previous is not None:
            try:
                per_call.ctxSetCurrent(previous)
            except per_call.CUDADriverError as e:
                raise _per_call_error(e, "giving the caller's context back") from None

    def __enter__(self):
        self._stack = getattr(self, "_stack", [])
        self._stack.append(self.enter())
        return self

    def __exit__(self, *exc):
        self.leave(self._stack.pop())

    def release(self):
        if self.handle is not None:
            check(driver.cuDevicePrimaryCtxRelease(self._dev), "cuDevicePrimaryCtxRelease")
            self.handle = None


class Module:
    """A cubin loaded into the current context; kernels looked up by their :class:`moecomm._abi.Kernel`
    entry, with each parameter's size checked against the ABI's struct."""

    def __init__(self, cubin):
        self.handle = check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")

    def function(self, kernel):
        f = check(driver.cuModuleGetFunction(self.handle, kernel.symbol.encode()), f"loading {kernel.name}")
        for i, struct in enumerate(kernel.params):
            _, size = check(driver.cuFuncGetParamInfo(f, i), f"{kernel.name} parameter {i}")
            if size != ctypes.sizeof(struct):
                raise CompileError(f"{kernel.name}: parameter {i} is {size} bytes on the device, "
                                   f"{ctypes.sizeof(struct)} in moecomm/_abi.py ({struct.__name__})")
        if driver.cuFuncGetParamInfo(f, len(kernel.params))[0] == driver.CUresult.CUDA_SUCCESS:
            raise CompileError(f"{kernel.name}: takes more parameters than moecomm/_abi.py declares")
        return f

    def unload(self):
        if self.handle is not None:
            check(driver.cuModuleUnload(self.handle), "cuModuleUnload")
            self.handle = None


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: its id, then (at offset 8) a 64-byte union whose first int is all the attribute
    used here takes."""
    _fields_ = [("id", ctypes.c_int), ("_pad", ctypes.c_int), ("value", ctypes.c_int), ("_rest", ctypes.c_byte * 60)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


@functools.cache
def _launch_ex():
    """cuLaunchKernelEx as a ctypes function (looked up once)."""
    address = check(driver.cuGetProcAddress(b"cuLaunchKernelEx", 12000,
                                            driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT),
                    "cuGetProcAddress(cuLaunchKernelEx)")[0]
    if not int(address):
        raise MoeCommError("this CUDA driver has no cuLaunchKernelEx (CUDA 12.0 or newer is needed)")
    signature = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
    return signature(int(address))


class Launch:
    """One kernel with its launch configuration and parameter block built once. ``launch(stream)`` launches it
    with the current contents of ``params`` (ctypes structures the owner keeps updating; a launch copies them),
    one launch at a time (the configuration holds the stream).

    A programmatic launch is one only where the stream is being captured into a CUDA graph: there the kernel
    may start before the graph's previous kernel ends (it waits for it first), which every replay gains. An
    eager launch is a plain one through CuPy's ``launchKernel``: an eager caller is usually slower than the
    device, so its host time is what counts (a ctypes call of ``cuLaunchKernelEx`` measured +0.2 to +1.0 µs
    per launch beside it on an H200's host).

    Args:
        function: the kernel's CUfunction (:meth:`Module.function`).
        kernel: its :class:`moecomm._abi.Kernel` entry.
        blocks: grid size (blocks of ``kernel.threads`` threads).
        params: one instance of each struct in ``kernel.params``, in order.
        programmatic: launch it as a programmatic dependent launch when captured (the kernel must be
            ``kernel.dependent``: it waits for the stream's previous kernel first).
    """

    def __init__(self, function, kernel, blocks, *params, programmatic=False):
        if tuple(type(p) for p in params) != kernel.params:
            raise TypeError(f"{kernel.name} takes {[p.__name__ for p in kernel.params]}, "
                            f"got {[type(p).__name__ for p in params]}")
        if programmatic and not kernel.dependent:
            raise TypeError(f"{kernel.name} does not wait for the kernel before it: not a programmatic launch")
        self.function, self.name, self.threads, self.blocks = function, kernel.name, kernel.threads, int(blocks)
        self._function = int(function)
        self._params = params  # kept alive: the pointer array points into them
        self._pointers = (ctypes.c_void_p * len(params))(*(ctypes.addressof(p) for p in params))
        self._address = ctypes.addressof(self._pointers)
        self._launch_ex = None  # cuLaunchKernelEx, for the launches being captured (programmatic only)
        if programmatic:
            self._attribute = _LaunchAttribute(
                id=int(driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION), value=1)
            self._config = _LaunchConfig(grid=(self.blocks, 1, 1), block=(self.threads, 1, 1),
                                         attrs=ctypes.pointer(self._attribute), num_attrs=1)
            self._config_address = ctypes.addressof(self._config)
            self._launch_ex = _launch_ex()

    def __call__(self, stream):
        if self._launch_ex is not None and is_capturing(stream):
            self._config.stream = stream
            code = self._launch_ex(self._config_address, self._function, self._address, None)
            if code:
                raise error(driver.CUresult(code), f"launching {self.name}")
            return
        try:
            per_call.launchKernel(self._function, self.blocks, 1, 1, self.threads, 1, 1, 0, stream, self._address, 0)
        except per_call.CUDADriverError as e:
            raise _per_call_error(e, f"launching {self.name}") from None


class StreamOrder:
    """Orders one stream after another with a reused event (the wait captures the event as recorded)."""

    def __init__(self):
        self.event = check(driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")

    def after(self, producer, consumer):
        """Work queued on ``consumer`` from now on waits for the work queued on ``producer`` so far.

        While ``consumer`` is being captured into a CUDA graph and ``producer`` is not, nothing is waited
        for: the producer's work is not part of the graph, CUDA refuses such a wait
        (CUDA_ERROR_STREAM_CAPTURE_ISOLATION), and whoever launches the graph orders its replays."""
        if not is_capturing(producer) and is_capturing(consumer):
            return
        check(driver.cuEventRecord(self.event, producer), "cuEventRecord")
        check(driver.cuStreamWaitEvent(consumer, self.event, 0), "cuStreamWaitEvent")

    def destroy(self):
        if self.event is not None:
            check(driver.cuEventDestroy(self.event), "cuEventDestroy")
            self.event = None


def new_event():
    """A CUDA event that records timing (moecomm's timing=True)."""
    return check(driver.cuEventCreate(0), "cuEventCreate")


def record(event, stream):
    check(driver.cuEventRecord(event, stream), "cuEventRecord")


def elapsed_ms(start, end):
    return check(driver.cuEventElapsedTime(start, end), "cuEventElapsedTime")


def destroy_event(event):
    check(driver.cuEventDestroy(event), "cuEventDestroy")


def is_capturing(stream):
    """Whether ``stream`` is being captured into a CUDA graph (or its capture was invalidated)."""
    try:
        return per_call_runtime.streamIsCapturing(stream)  # a bool
    except per_call_runtime.CUDARuntimeError as e:
        raise MoeCommError(f"cudaStreamIsCapturing failed: {e}") from None


def copy_async(dst, src, nbytes, stream):
    """Copy ``nbytes`` of device memory from ``src`` to ``dst`` (addresses) on ``stream``."""
    per_call_runtime.memcpyAsync(dst, src, nbytes, per_call_runtime.memcpyDeviceToDevice, stream)


def stream_synchronize(stream):
    check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")


def context_synchronize():
    """Wait for all work of the current context (for rare calls: the streams a caller used may be gone)."""
    check(driver.cuCtxSynchronize(), "cuCtxSynchronize")


def pointer_device(ptr):
    """CUDA device ordinal of the device (or managed) memory at ``ptr``; None for host or unknown memory."""
    attr = driver.CUpointer_attribute
    err, kind = driver.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr)
    if err or int(kind) not in _DEVICE_MEMORY:
        return None
    err, ordinal = driver.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
    return None if err else int(ordinal)
