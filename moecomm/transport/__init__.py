"""Transports: the CPU host transport (numpy + MPI) and the GPU transports (NVSHMEM, CUDA IPC). See :mod:`.base`."""
from .base import AllToAllBackend, Transport

__all__ = ["AllToAllBackend", "Transport"]
