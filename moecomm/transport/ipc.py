"""The ipc GPU transport: the ranks of one node, without NVSHMEM.

Each rank allocates one symmetric heap with cudaMalloc ($MOECOMM_IPC_HEAP_MB, default 4 GiB) and exports
it with CUDA IPC; the handles are gathered over the bootstrap and every rank maps every peer's heap.
Symmetric arrays are carved from the heap at the same offset on every rank: allocation is collective and
in the same order everywhere, and every rank runs the same first-fit allocator. The kernels are built
against ``cuda/transport_ipc.cuh``: a peer's address is this rank's address plus the offset of the peer's
heap as mapped here (the transport's peer table), data and signals are stores into peer memory over NVLink, and no
NVSHMEM device library is linked. Bounded waits, collective errors and masking are those of every GPU
transport (moecomm/transport/gpu.py, gpu_alltoall.py).
"""
import os

import numpy as np

from .. import _constants as C
from .._errors import InvalidArgument, MoeCommError
from .gpu import GpuTransport

_ALIGN = 256  # bytes: every symmetric array starts on this boundary


def heap_bytes():
    """Bytes of one rank's symmetric heap: $MOECOMM_IPC_HEAP_MB megabytes, else the default."""
    raw = os.environ.get(C.IPC_HEAP_ENV)
    if not raw:
        return C.IPC_HEAP_BYTES
    try:
        mb = int(raw)
    except ValueError:
        mb = 0
    if mb <= 0:
        raise InvalidArgument(f"${C.IPC_HEAP_ENV} must be a positive number of megabytes, got {raw!r}")
    return mb << 20


class IpcTransport(GpuTransport):
    name = "ipc"
    variant = "ipc"

    def _start_runtime(self, dev):
        rt = self._cupy.cuda.runtime
        self._size = heap_bytes()
        self._base = rt.malloc(self._size)
        handles = self.bootstrap.allgather(bytes(rt.ipcGetMemHandle(self._base)), self.timeout_s, "init")
        self._bases = [self._base if q == self.rank else rt.ipcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess)
                       for q, h in enumerate(handles)]
        self._holes = [(0, self._size)]  # free (offset, bytes), by offset
        self._used = {}                  # offset -> bytes of each live array

    def _load_module(self, module):
        pass  # the module holds no state of the transport: peers are reached through the peer table

    def peer_offsets(self):
        return [base - self._base for base in self._bases]  # every peer of the node is mapped

    def _array(self, address, shape, dtype):
        cp = self._cupy
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        memory = cp.cuda.UnownedMemory(address, nbytes, self, self.device)
        return cp.ndarray(tuple(shape), dtype, cp.cuda.MemoryPointer(memory, 0))

    def symmetric(self, shape, dtype):
        need = max(_ALIGN, -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // _ALIGN) * _ALIGN)
        hole = next((i for i, (_, n) in enumerate(self._holes) if n >= need), None)
        if hole is None:
            raise MoeCommError(f"the ipc heap ({self._size >> 20} MiB per rank) has no room for {need} bytes "
                               f"({sum(self._used.values()) >> 20} MiB in use): set ${C.IPC_HEAP_ENV} higher")
        offset, n = self._holes[hole]
        self._holes[hole:hole + 1] = [(offset + need, n - need)] if n > need else []
        self._used[offset] = need
        return self._array(self._base + offset, shape, dtype)

    def peer_array(self, array, pe):
        return self._array(self._bases[pe] + array.data.ptr - self._base, array.shape, array.dtype)

    def free(self, array):
        offset = array.data.ptr - self._base
        size = self._used.pop(offset)
        holes = sorted(self._holes + [(offset, size)])
        merged = [holes[0]]
        for o, n in holes[1:]:  # join neighbours
            if merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((o, n))
        self._holes = merged

    def _stop_runtime(self):
        rt = self._cupy.cuda.runtime
        for q, base in enumerate(self._bases):
            if q != self.rank:
                rt.ipcCloseMemHandle(base)
        self.bootstrap.barrier(self.timeout_s, "finalize")  # no peer maps our heap any more
        rt.free(self._base)
        self.module.unload()
