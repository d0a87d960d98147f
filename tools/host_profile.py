"""Where the host time of an eager dispatch + combine goes, R1-decode shapes, CuPy inputs.

    mpirun -np 2 python tools/host_profile.py [--calls 200] [--transport nvshmem|ipc] [--parts]

The device is kept busy by a delay kernel queued first, so launches never wait for the launch queue;
rank 0 prints the functions by their own time per call pair (profiling inflates every Python frame, so
read the shares, not the sums; the benchmark gives the unprofiled figures). ``--parts`` instead times
each step of the call path alone, unprofiled (median over repetitions of the mean of a loop): the whole
calls, the context check, the stream's resolution, the arguments' reading, one kernel launch through moecomm
(plain, and programmatic as an eager call makes it), the capture query, a programmatic ``cuLaunchKernelEx``
(what a launch being captured takes), and one launch and one context query through cuda.bindings and CuPy.
"""
import argparse
import cProfile
import dataclasses
import pstats
import statistics
import time

import cupy
import numpy as np

import moecomm
from moecomm import _abi, _cuda
from moecomm.bench import delay_kernel


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200, help="profiled dispatch + combine pairs (default 200)")
    p.add_argument("--transport", default="nvshmem", choices=["nvshmem", "ipc"], help="GPU transport (default nvshmem)")
    p.add_argument("--parts", action="store_true", help="time each step of the call path alone")
    args = p.parse_args()
    comm = moecomm.init(transport=args.transport)
    W, M, E, K, H, S = comm.world_size, 128, 256, 8, 7168, 56
    L = E // W
    a2a = moecomm.AllToAll(comm, M, E, K, H, S, "float8_e4m3fn", "bfloat16")
    rng = np.random.default_rng(comm.rank)
    x = cupy.asarray(rng.integers(0, 255, (M, H), np.uint8) & 0x77)
    xs, w = cupy.ones((M, S), np.float32), cupy.asarray(rng.random((M, K), np.float32))
    idx = cupy.asarray(np.argsort(rng.random((M, E)), axis=1)[:, :K].astype(np.int32))
    m = cupy.asarray(np.array([M], np.int32))
    n, ex = cupy.zeros(L, np.int32), cupy.zeros((L, M * W, H), np.uint8)
    es, out = cupy.zeros((L, M * W, S), np.float32), cupy.zeros((M, H), np.uint16)
    y = cupy.full((L, M * W, H), 0x3C00, np.uint16)
    delay_args, delay = delay_kernel(comm.transport)
    delay_args.ns = int(2e9)
    stream = cupy.cuda.get_current_stream().ptr

    def pair():
        a2a.dispatch(n, ex, es, x, xs, idx, m, weights=w)
        a2a.combine(out, idx, None, y, m)

    pair()
    a2a.synchronize()
    comm.barrier()
    if args.parts:
        parts(comm, a2a, delay_args, delay, (n, ex, es, x, xs, idx, m, w, out, y), stream)
        a2a.destroy()
        comm.finalize()
        return
    delay(stream)  # at most 2 s of device work ahead of the calls (they take well under that)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        pair()
    prof.disable()
    a2a.synchronize()
    if comm.rank == 0:
        stats = pstats.Stats(prof)
        rows = sorted(((v[2], f"{k[2]} ({k[0].rsplit('/', 1)[-1]}:{k[1]})") for k, v in stats.stats.items()),
                      reverse=True)
        total = sum(t for t, _ in rows)
        print(f"host time per dispatch + combine pair under cProfile: {total / args.calls * 1e6:.1f} us")
        for t, name in rows[:16]:
            print(f"  {t / args.calls * 1e6:6.2f} us  {100 * t / total:5.1f} %  {name}")
    a2a.destroy()
    comm.finalize()


def timed(step, loops, busy=None, reps=15):
    """Median over ``reps`` of the mean microseconds of ``loops`` calls of ``step()``; ``busy()`` first
    (a device delay ahead of launches), and the stream drained after each repetition."""
    means = []
    for _ in range(reps):
        if busy:
            busy()
        t0 = time.perf_counter_ns()
        for _ in range(loops):
            step()
        means.append((time.perf_counter_ns() - t0) / loops / 1e3)
        cupy.cuda.get_current_stream().synchronize()
    return statistics.median(means)


def parts(comm, a2a, delay_args, delay, arrays, stream):
    """Each step of the eager call path timed alone (rank 0 prints; every rank runs the collective ones)."""
    from moecomm.alltoall import CombineArgs, DispatchArgs
    from moecomm._arrays import DeviceBuffer, stream_handle

    cupys = dict(zip(("n", "ex", "es", "x", "xs", "idx", "m", "w", "out", "y"), arrays))
    dtypes = dict(ex=moecomm.float8_e4m3fn, x=moecomm.float8_e4m3fn, y=moecomm.bfloat16, out=moecomm.bfloat16)
    b = {k: DeviceBuffer(a.data.ptr, a.shape, dtypes.get(k, a.dtype), comm.device, a) for k, a in cupys.items()}

    def busy():  # 20 ms of device work ahead of a repetition's launches (which then launch with ns=0)
        delay_args.ns = int(20e6)
        delay(stream)
        delay_args.ns = 0

    def calls(kind, a):
        def dispatch():
            a2a.dispatch(a["n"], a["ex"], a["es"], a["x"], a["xs"], a["idx"], a["m"], weights=a["w"], stream=stream)

        def combine():
            a2a.combine(a["out"], a["idx"], None, a["y"], a["m"], stream=stream)

        comm.barrier()
        total = timed(lambda: (dispatch(), combine()), 50, busy)
        comm.barrier()
        return {f"{kind}: dispatch + combine": total}

    rows = {}
    rows.update(calls("DeviceBuffer", b))
    rows.update(calls("CuPy", cupys))
    ctx = a2a._context
    rows["context enter + leave"] = timed(lambda: ctx.leave(ctx.enter()), 2000)
    rows["stream_handle(int)"] = timed(lambda: stream_handle(stream), 2000)
    cs = cupy.cuda.ExternalStream(stream)
    rows["stream_handle(CuPy stream)"] = timed(lambda: stream_handle(cs), 2000)
    rows["arrays.begin"] = timed(lambda: a2a._arrays.begin(stream, b["x"]), 2000)
    d_args = DispatchArgs(b["n"], b["ex"], b["es"], b["x"], b["xs"], b["idx"], b["m"], b["w"], None, None, None,
                          stream, False)
    c_args = CombineArgs(b["out"], b["idx"], None, b["y"], b["m"], stream=stream)
    rows["read dispatch (DeviceBuffer)"] = timed(lambda: a2a._read(d_args, False, False), 2000)
    rows["read combine (DeviceBuffer)"] = timed(lambda: a2a._read(c_args, False, False), 2000)
    rows["arrays.order"] = timed(a2a._arrays.order, 2000)
    backend = a2a._backend
    rows["check_error"] = timed(lambda: backend.check_error(timeout_only=True), 2000)
    from cuda.bindings import driver
    launch = delay
    rows["launch (moecomm's Launch)"] = timed(lambda: launch(stream), 100, busy)
    f, threads, addr = launch.function, launch.threads, launch._address
    kernel = dataclasses.replace(_abi.KERNELS["moecomm_delay"], dependent=True)  # the attribute's cost alone
    dependent = _cuda.Launch(f, kernel, 1, delay_args, programmatic=True)
    rows["launch, programmatic, eager (moecomm's Launch: capture query + launchKernel)"] = timed(
        lambda: dependent(stream), 100, busy)
    rows["capture query (_cuda.is_capturing)"] = timed(lambda: _cuda.is_capturing(stream), 2000)
    dependent._config.stream = stream
    ex, config, function = dependent._launch_ex, dependent._config_address, dependent._function
    rows["cuLaunchKernelEx by ctypes, programmatic (a captured launch's path)"] = timed(
        lambda: ex(config, function, addr, None), 100, busy)
    rows["cuLaunchKernel (cuda.bindings)"] = timed(
        lambda: driver.cuLaunchKernel(f, 1, 1, 1, threads, 1, 1, 0, stream, addr, 0), 100, busy)
    fi, drv = int(f), cupy.cuda.driver
    rows["launchKernel (CuPy's driver module)"] = timed(
        lambda: drv.launchKernel(fi, 1, 1, 1, threads, 1, 1, 0, stream, addr, 0), 100, busy)
    rows["cuCtxGetCurrent (cuda.bindings)"] = timed(driver.cuCtxGetCurrent, 2000)
    rows["ctxGetCurrent (CuPy's driver module)"] = timed(drv.ctxGetCurrent, 2000)
    if comm.rank == 0:
        for name, us in rows.items():
            print(f"  {us:7.2f} us  {name}")


if __name__ == "__main__":
    main()
