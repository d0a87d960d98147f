"""Transports: the CPU host transport (numpy + MPI) and the GPU transports (NVSHMEM, CUDA IPC). See :mod:`.base`."""
from .base import AllToAllBackend, Transport

# The GPU transports moecomm.init(transport=<name>) starts: {name: (module in moecomm.transport, class)}. Each
# name is also its kernels' module variant (moecomm._jit.VARIANTS: the device header it is built against).
GPU_TRANSPORTS = {"nvshmem": ("nvshmem", "NvshmemTransport"), "ipc": ("ipc", "IpcTransport")}

__all__ = ["AllToAllBackend", "Transport", "GPU_TRANSPORTS"]
