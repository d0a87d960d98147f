"""Transports: the CPU host transport (numpy + MPI) and the NVSHMEM GPU transport. See :mod:`.base`."""
from .base import AllToAllBackend, CombineArgs, DispatchArgs, Transport

__all__ = ["AllToAllBackend", "CombineArgs", "DispatchArgs", "Transport"]
