"""moecomm: Mixture-of-Experts dispatch and combine across GPUs (NVSHMEM) or CPU ranks, without PyTorch.

    comm = moecomm.init()                       # under mpirun / mpiexec
    a2a = moecomm.AllToAll(comm, max_num_tokens, num_experts, experts_per_token, hidden_dim, ...)
    a2a.dispatch(...); ...experts...; a2a.combine(...)
    a2a.destroy(); comm.finalize()
"""
from ._arrays import DeviceBuffer
from ._config import AllToAllConfig, Formats, Launch, Placement, Telemetry
from ._dtypes import bfloat16, float8_e4m3fn, float16, float32
from ._errors import (CapacityExceeded, CommBroken, CommTimeout, CompileError, ConcurrentCall, ExpertMapMismatch,
                      InvalidArgument, InvalidRouting, MoeCommError, OutOfStep, PeerError, PeerExited)
from .alltoall import AllToAll, CombineArgs, DispatchArgs, RoutingPlan, SourceLayout
from .comm import Bootstrap, Communicator, init

__version__ = "0.2.0"

__all__ = ["AllToAll", "AllToAllConfig", "Bootstrap", "CapacityExceeded", "CombineArgs", "CommBroken", "CommTimeout",
           "Communicator", "CompileError", "ConcurrentCall", "DeviceBuffer", "DispatchArgs", "ExpertMapMismatch",
           "Formats", "InvalidArgument", "InvalidRouting", "Launch", "MoeCommError", "OutOfStep", "PeerError",
           "PeerExited", "Placement", "RoutingPlan", "SourceLayout", "Telemetry", "bfloat16", "float16",
           "float8_e4m3fn", "float32", "init"]
