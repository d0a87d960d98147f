"""The NVSHMEM GPU transport: NVSHMEM started by unique id, symmetric memory on its heap, kernels built
against ``cuda/transport_nvshmem.cuh`` with NVSHMEM's device library (NVLink peers by load/store, network
peers by puts: the path across nodes).

Host side through nvshmem4py (``nvshmem.core`` for init, symmetric arrays and finalize;
``nvshmem.bindings`` for module registration and pointer queries). Two things of nvshmem4py 0.4.1 are
bypassed on purpose: ``nvshmem.core.module_init`` prints to stdout and ``module_finalize`` raises
``AttributeError`` as shipped, so the CUmodule is registered with ``nvshmem.bindings.cumodule_init`` /
``cumodule_finalize`` directly. Device code is built by :mod:`moecomm._jit` (nvshmem4py's device-bitcode
finder expects a file the NVSHMEM 3.4.5 wheel does not ship).

NVSHMEM is started by unique id: rank 0 creates the id, the bootstrap (MPI, torch.distributed, ...)
gathers its bytes to every rank, every rank calls ``nvshmem.core.init(..., initializer_method="uid")``
after binding GPU ``local_rank``. This needs no NVSHMEM build matched to the MPI library (its MPI
bootstrap plugin would).

NVSHMEM's proxy thread: where no network transport needs it (one NVLink node; also IBGDA), NVSHMEM still
starts a "minimal" proxy thread that spins on a CPU for device-side global exit and NVSHMEM's own device
wait timeouts, neither of which moecomm uses. Under a launcher that binds each rank to one core (Open
MPI's default for two ranks) it takes that core from the rank's host thread for whole scheduler slices:
on 2xH200, so bound, eager calls' p99 reached 4.1-8.7 ms in every run (at most 0.37 ms with the thread off,
up to 128 tokens), and dispatch() + combine() at 1 token had a mean of 78-114 us against 45-74
(benchmarks/NOTES.md, "NVSHMEM's proxy thread"). So ``NVSHMEM_DISABLE_LOCAL_ONLY_PROXY`` defaults to 1
here (a value the caller set is kept); NVSHMEM ignores it where a transport needs the proxy (InfiniBand
through IBRC, UCX), and there each rank needs a second CPU.
"""
import os

import numpy as np

from .. import _constants as C
from .._errors import MoeCommError
from .gpu import GpuTransport


PROXY_ENV = "NVSHMEM_DISABLE_LOCAL_ONLY_PROXY"


class NvshmemTransport(GpuTransport):
    name = "nvshmem"
    variant = "nvshmem"

    def _start_runtime(self, dev):
        os.environ.setdefault(PROXY_ENV, "1")  # before NVSHMEM reads its options (module docstring)
        import nvshmem.bindings
        import nvshmem.core
        self._nvshmem, self._bindings = nvshmem.core, nvshmem.bindings
        uid = self._nvshmem.get_unique_id(empty=self.rank != 0)
        uid_bytes = uid._data.view(np.uint8)
        uid_bytes[:] = np.frombuffer(self.bootstrap.allgather(uid_bytes.tobytes(), self.timeout_s, "init")[0],
                                     np.uint8)
        self._nvshmem.init(device=dev, uid=uid, rank=self.rank, nranks=self.world_size, initializer_method="uid")
        if self._nvshmem.my_pe() != self.rank:
            raise MoeCommError(f"NVSHMEM PE {self._nvshmem.my_pe()} != rank {self.rank}")
        self._arrays = []  # symmetric arrays we own, freed in allocation order at finalize
        self._offsets = None  # the peer table (peer_offsets), from the first symmetric array

    def _load_module(self, module):
        self._bindings.cumodule_init(int(module.handle))

    def symmetric(self, shape, dtype):
        with self.context:
            a = self._nvshmem.array(tuple(shape), dtype=np.dtype(dtype).name)
        self._arrays.append(a)
        offsets = [self._offset(a.data.ptr, pe) for pe in range(self.world_size)]
        if self._offsets is None:
            self._offsets = offsets
        elif offsets != self._offsets:  # the kernels' peer table holds one offset per rank
            raise MoeCommError(f"NVSHMEM maps this symmetric array of rank {self.rank} at other offsets on the peers "
                               f"({offsets}) than its first one ({self._offsets}): moecomm's peer table assumes "
                               f"each rank's heap is mapped as one range")
        return a

    def _offset(self, address, pe):
        mapped = self._bindings.ptr(address, pe)
        return mapped - address if mapped else C.PEER_UNMAPPED

    def peer_offsets(self):
        return self._offsets

    def peer_array(self, array, pe):
        if pe == self.rank:
            return array
        with self.context:
            if not self._bindings.ptr(array.data.ptr, pe):
                return None
            return self._nvshmem.get_peer_array(array, pe)

    def free(self, array):
        self._arrays = [a for a in self._arrays if a is not array]  # by identity: == is elementwise
        with self.context:
            self._nvshmem.free_array(array)

    def _stop_runtime(self):
        for a in self._arrays:
            self._nvshmem.free_array(a)
        self._arrays = []
        self._bindings.cumodule_finalize(int(self.module.handle))
        self.module.unload()
        self._nvshmem.finalize()
