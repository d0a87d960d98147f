"""The transport boundary: what a new transport implements.

A transport moves bytes between the ranks of one communicator. :class:`moecomm.AllToAll` validates every
argument in Python (dtype, shape, contiguity, device) and then calls a backend made by
:meth:`Transport.new_alltoall` with the checked arrays, so a backend never sees bad input. Arrays reach a
backend as numpy arrays (``memory == "host"``) or as :class:`moecomm.DeviceBuffer` (``memory == "device"``).
"""
import abc
from dataclasses import dataclass

import numpy as np


@dataclass
class DispatchArgs:
    """Checked arguments of one dispatch (shapes in :meth:`moecomm.AllToAll.dispatch`)."""
    out_expert_num_tokens: object
    out_expert_x: object
    out_expert_x_scale: object
    dp_x: object
    dp_x_scale: object
    indices: object
    bound_m: object
    weights: object


@dataclass
class CombineArgs:
    """Checked arguments of one combine (shapes in :meth:`moecomm.AllToAll.combine`)."""
    out_tokens: object
    indices: object
    weights: object
    expert_y: object
    bound_m: object


class AllToAllBackend(abc.ABC):
    """One AllToAll's transport-side state: buffers sized at construction, reused by every call."""

    @abc.abstractmethod
    def dispatch(self, args: DispatchArgs, do_send: bool, do_recv: bool, stream) -> None:
        """Send (``do_send``) and/or receive and unpack (``do_recv``). Collective."""

    @abc.abstractmethod
    def combine(self, args: CombineArgs, do_send: bool, do_recv: bool, stream) -> None:
        """Send expert outputs back and/or receive and sum them. Collective."""

    def synchronize(self, stream) -> None:
        """Wait for this AllToAll's work on ``stream``; raise errors the device recorded. Not collective."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Release buffers. Collective; called at most once."""


class Transport(abc.ABC):
    """A communicator's data path. ``name`` and ``memory`` ("host" or "device") are class attributes."""
    name = ""
    memory = ""
    device = -1  # CUDA device ordinal for device transports

    @abc.abstractmethod
    def new_alltoall(self, cfg, timeout_s) -> AllToAllBackend:
        """Create the backend for one AllToAll configuration (collective)."""

    @abc.abstractmethod
    def check_peers(self, nbytes: int, timeout_s: float) -> None:
        """Exchange ``nbytes`` with every rank and verify them; raise on loss, corruption or timeout."""

    @abc.abstractmethod
    def finalize(self) -> None:
        """Release everything the transport holds (collective)."""


def peer_pattern(src, dst, nbytes):
    """The bytes rank ``src`` sends rank ``dst`` in a peer check (uint8, broadcast over src/dst, then nbytes)."""
    i = np.arange(nbytes, dtype=np.int64)
    return ((np.asarray(src)[..., None] * 131 + np.asarray(dst)[..., None] * 17 + i * 7) & 0xFF).astype(np.uint8)
