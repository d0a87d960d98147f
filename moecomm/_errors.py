"""Exception types.

Two roots, as in nvshmem4py: :class:`InvalidArgument` for caller misuse (raised before anything is
launched or sent, so nothing is corrupted and the next call works), and :class:`MoeCommError` for
failures of the library, a peer or the device.
"""


class MoeCommError(RuntimeError):
    """A failure inside moecomm, the transport, a peer or the device."""


class InvalidArgument(ValueError):
    """A call was given something it cannot take; the message says what was expected."""


class InvalidRouting(MoeCommError):
    """Invalid routing input reached dispatch: an expert id outside ``[0, num_experts)`` or repeated within
    one token, or a ``bound_m`` outside ``[0, min(rows, max_num_tokens)]`` (read on the device on GPUs).

    Raised on every rank of the group, so that no rank is left waiting; the buffers of the call are
    unspecified, the next valid call is correct.
    """


class CommTimeout(MoeCommError):
    """A bounded wait for a peer expired.

    Attributes:
        peer: rank that did not answer (-1 if unknown).
        phase: name of the phase that was waiting (``"dispatch"``, ``"combine"``, ...).
    """

    def __init__(self, message, peer=-1, phase=""):
        super().__init__(message)
        self.peer = peer
        self.phase = phase


class CompileError(MoeCommError):
    """NVRTC or nvJitLink rejected a kernel; the message carries the compiler log."""
