"""Where the host time of an eager dispatch + combine goes (cProfile), R1-decode shapes, CuPy inputs.

    mpirun -np 2 python tools/host_profile.py [--calls 200] [--transport nvshmem|ipc]

The device is kept busy by a delay kernel queued first, so launches never wait for the launch queue;
rank 0 prints the functions by their own time per call pair (profiling inflates every Python frame, so
read the shares, not the sums; the benchmark gives the unprofiled figures).
"""
import argparse
import cProfile
import pstats

import cupy
import numpy as np

import moecomm
from moecomm.bench import delay_kernel


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--transport", default="nvshmem", choices=["nvshmem", "ipc"])
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


if __name__ == "__main__":
    main()
