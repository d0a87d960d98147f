"""How programs embed moecomm, checked on GPUs under MPI (every rank checks its own results):

    mpirun -np 2 python tests/mpi_embedding.py

* the caller's current device is another GPU (set in CuPy and torch): calls run on the communicator's
  GPU and leave the caller's current device as it was;
* a producer writes the tokens on a side stream after a long spin and hands them over without a sync: as
  a torch tensor (torch's current stream), through ``__dlpack__`` alone, as a CuPy array (CuPy's current
  stream) and as a JAX array (DLPack with our stream); without the ordering the kernels would read the
  tokens before they are written;
* ``stream=`` given as a torch stream, a CuPy stream, a cuda.core stream and an int handle.

JAX here sees both GPUs (XLA_PYTHON_CLIENT_PREALLOCATE=false, arrays placed on the rank's GPU) and moves
the current device as it works, which is the point. Prints "<n> checks on <w> ranks: <f> failures".
"""
import contextlib
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX sees both GPUs in both ranks

import cupy  # noqa: E402
import numpy as np  # noqa: E402

import moecomm  # noqa: E402
from moecomm import reference  # noqa: E402
from report import finish  # noqa: E402

M, H, K, SPIN_CYCLES = 64, 512, 2, 40_000_000  # ~20 ms of spinning before a late producer writes
_spin = cupy.RawKernel(r'''
extern "C" __global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {}
}''', "spin")


def data(world, seed):
    """The global random inputs (every rank draws the same) and each rank's expected outputs."""
    rng = np.random.default_rng(seed)
    E = 4 * world
    x = [(rng.standard_normal((M, H)) * 2).astype(moecomm.bfloat16) for _ in range(world)]
    idx = [np.argsort(rng.random((M, E)), axis=1)[:, :K].astype(np.int32) for _ in range(world)]
    w = [rng.random((M, K), np.float32) for _ in range(world)]
    ref = reference.dispatch(x, None, idx, E, world, M)
    y = [r["expert_x"] for r in ref]  # the expert is the identity: combine returns sum_k w_k * x
    out = reference.combine(idx, w, y, [r["origin"] for r in ref], E, world, moecomm.bfloat16)
    return x, idx, w, ref, out


def run_layer(comm, a2a, x_obj, idx, w, stream, seed_data, label):
    """dispatch(x_obj) and combine with CuPy arrays for everything else; failures as strings."""
    x, idx_all, w_all, ref, want = seed_data
    r, L = comm.rank, a2a.cfg.num_local_experts
    with cupy.cuda.Device(comm.device):
        n = cupy.full(L, -1, np.int32)
        ex = cupy.full((L, M * comm.world_size, H), 0xFFFF, np.uint16)
        out = cupy.full((M, H), 0xFFFF, np.uint16)
        m = cupy.asarray(np.array([M], np.int32))
        idx_d, w_d = cupy.asarray(idx), cupy.asarray(w)
        cupy.cuda.get_current_stream().synchronize()
    a2a.dispatch(n, ex, None, x_obj, None, idx_d, m, weights=w_d, stream=stream)
    a2a.combine(out, idx_d, None, ex, m, stream=stream)
    a2a.synchronize(stream)
    fails = []
    counts = n.get()
    if not np.array_equal(counts, ref[r]["expert_num_tokens"]):
        fails.append(f"{label}: counts {counts.tolist()} != {ref[r]['expert_num_tokens'].tolist()}")
    got = out.get().view(moecomm.bfloat16).astype(np.float32)
    if not np.allclose(got, want[r].astype(np.float32), rtol=2 ** -6, atol=1e-2):
        fails.append(f"{label}: combined tokens differ from the reference (max diff "
                     f"{np.abs(got - want[r].astype(np.float32)).max():.3g})")
    return fails


class DLPackOnly:
    """A producer seen only through __dlpack__ (the generic path)."""
    def __init__(self, t):
        self.t = t

    def __dlpack__(self, stream=None):
        return self.t.__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


def current_device():
    from cuda.bindings import driver
    ctx = driver.cuCtxGetCurrent()[1]
    return None if ctx is None or int(ctx) == 0 else int(driver.cuCtxGetDevice()[1])


def main():
    import torch
    comm = moecomm.init()
    W, r, dev = comm.world_size, comm.rank, comm.device
    a2a = moecomm.AllToAll(comm, M, 4 * W, K, H, None, "bfloat16", "bfloat16")
    tdev = torch.device("cuda", dev)
    torch.cuda.set_device(tdev)
    with cupy.cuda.Device(dev):
        main_stream = cupy.cuda.Stream(non_blocking=True)
    fails, checks = [], 0

    def check(label, make, stream, seed):
        """make(x_rank) -> context manager yielding the x object, inside which dispatch is called."""
        nonlocal checks
        d = data(W, seed)
        with make(d[0][r]) as x_obj:
            fails.extend(run_layer(comm, a2a, x_obj, d[1][r], d[2][r], stream, d, label))
        checks += 1

    def torch_tensor(x):
        return torch.from_numpy(x.view(np.uint16).copy()).to(tdev).view(torch.bfloat16)

    @contextlib.contextmanager
    def torch_late(x, wrap=lambda t: t):
        src, t = torch_tensor(x), torch.empty((M, H), dtype=torch.bfloat16, device=tdev)
        torch.cuda.synchronize(tdev)
        side = torch.cuda.Stream(tdev)
        with torch.cuda.stream(side):  # the user's current stream while producing and calling
            torch.cuda._sleep(SPIN_CYCLES)
            t.copy_(src)
            yield wrap(t)

    @contextlib.contextmanager
    def cupy_late(x):
        with cupy.cuda.Device(dev):
            src = cupy.asarray(x.view(np.uint16))
            t = cupy.empty_like(src)
            side = cupy.cuda.Stream(non_blocking=True)
            cupy.cuda.Device(dev).synchronize()
            with side:
                _spin((1,), (1,), (np.int64(SPIN_CYCLES),))
                t[...] = src
                yield t

    @contextlib.contextmanager
    def jax_late(x):
        import jax
        import jax.numpy as jnp
        device = jax.devices()[dev]
        spin = jax.jit(lambda a, b: jax.lax.fori_loop(0, 200, lambda i, c: (c @ b) * 0.5, a))  # b = 2 I
        a = jax.device_put(jnp.asarray(x.astype(np.float32)[:, :64]), device)  # a late, slow producer
        b = jax.device_put(jnp.eye(64, dtype=jnp.float32) * 2, device)
        slow = spin(a, b)
        late = jnp.concatenate([slow, jax.device_put(jnp.asarray(x.astype(np.float32)[:, 64:]), device)], 1)
        yield late.astype(jnp.bfloat16)  # passed as it is: DLPack with our stream orders XLA's work first

    @contextlib.contextmanager
    def ready(x):
        yield torch_tensor(x)

    s = main_stream.ptr
    check("torch tensor written late on torch's current side stream", torch_late, s, 1)
    check("__dlpack__-only producer written late on a side stream", lambda x: torch_late(x, DLPackOnly), s, 2)
    check("CuPy array written late on CuPy's current side stream", cupy_late, s, 3)
    check("JAX array computed late (DLPack with our stream)", jax_late, s, 4)
    check("stream= a torch stream", ready, torch.cuda.Stream(tdev), 5)
    check("stream= a CuPy stream", ready, main_stream, 6)
    from cuda.core import Device
    check("stream= a cuda.core stream", ready, Device(dev).create_stream(), 7)
    check("stream=None (torch's current stream)", ready, None, 8)

    # the caller's current device is the other GPU, in CuPy, in torch and in the driver
    other = (dev + 1) % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.runtime.setDevice(other)
    torch.cuda.set_device(other)
    check("current device is the other GPU", ready, main_stream, 9)
    if current_device() != other or cupy.cuda.runtime.getDevice() != other or torch.cuda.current_device() != other:
        fails.append(f"the caller's current device changed: driver {current_device()}, CuPy "
                     f"{cupy.cuda.runtime.getDevice()}, torch {torch.cuda.current_device()}, expected {other}")
    a2a.synchronize()
    checks += 1
    torch.cuda.set_device(dev)
    cupy.cuda.runtime.setDevice(dev)

    a2a.destroy()
    finish(comm, fails, checks)


if __name__ == "__main__":
    main()
