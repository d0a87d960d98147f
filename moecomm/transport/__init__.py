"""Transports: the CPU host transport (numpy + MPI) and the NVSHMEM GPU transport. See :mod:`.base`."""
from .base import AllToAllBackend, Transport

__all__ = ["AllToAllBackend", "Transport"]
