"""GPU bring-up check, run under MPI on GPUs: NVSHMEM init through moecomm.init(), no thread left spinning
on a CPU, symmetric CuPy arrays, peer mapping, the peer-check kernel (put with signal + bounded wait), and a
timeout that names the peer.

    mpirun -np 2 python tests/mpi_peer_check.py      # GPU transport: "auto" ($MOECOMM_TRANSPORT picks one)

The timeout comes last: it breaks the communicator (the ranks' peer checks are out of step from then on),
so the ranks report over plain MPI and leave without a collective teardown (moecomm ends such a process
without MPI's finalization, which Open MPI's launcher reports as an improper exit: read the printed result).
"""
import os
import sys
import time

import cupy
import numpy as np

import moecomm


def cpu_ticks():
    """{thread id: (name, user + system clock ticks)} of this process's threads."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[tid] = (stat[stat.index("(") + 1:stat.rindex(")")], int(fields[11]) + int(fields[12]))
    return out


def busy_threads(seconds=1.0):
    """Threads that used more than half a CPU while this one slept for ``seconds`` (a thread that spins
    takes a core from the rank's host thread whenever the launcher binds the rank to one core)."""
    before = cpu_ticks()
    time.sleep(seconds)
    hz = os.sysconf("SC_CLK_TCK")
    used = {tid: (name, (ticks - before[tid][1]) / hz / seconds) for tid, (name, ticks) in cpu_ticks().items()
            if tid in before}
    return [f"{name} ({tid}): {share:.0%} of a CPU" for tid, (name, share) in used.items() if share > 0.5]


def main():
    comm = moecomm.init()
    t = comm.transport
    fails = [f"a thread spins after init(): {b}" for b in busy_threads()]
    # symmetric memory: write through the peer mapping, read locally
    a = t.symmetric((1024,), np.int32)
    a.fill(-1)
    cupy.cuda.get_current_stream().synchronize()
    comm.barrier()
    nxt = (comm.rank + 1) % comm.world_size
    peer = t.peer_array(a, nxt)
    if peer is None:
        fails.append(f"rank {nxt} not load/store reachable (expected on one NVLink node)")
    else:
        peer[:] = cupy.arange(1024, dtype=cupy.int32) + 1000 * comm.rank
    cupy.cuda.get_current_stream().synchronize()
    comm.barrier()
    prev = (comm.rank - 1) % comm.world_size
    if peer is not None and not np.array_equal(a.get(), np.arange(1024) + 1000 * prev):
        fails.append("bytes written through the peer mapping did not arrive")
    # the peer-check kernel, repeated (signals are counters: no reset between checks)
    t0 = time.perf_counter()
    for _ in range(20):
        comm.check_peers(1 << 16)
    per = (time.perf_counter() - t0) / 20
    # a rank that skips: the waiting rank gets CommTimeout naming it, within the timeout
    comm.barrier()
    if comm.rank == 0 and comm.world_size > 1:
        t0 = time.perf_counter()
        try:
            comm.check_peers(1 << 16, timeout=1.0)
            fails.append("skipped peer: no timeout")
        except moecomm.CommTimeout as e:
            took = time.perf_counter() - t0
            if e.peer not in range(1, comm.world_size) or not 0.9 < took < 5:
                fails.append(f"timeout named peer {e.peer} after {took:.2f} s")
            print(f"timeout raised after {took:.2f} s: {e}")
    else:
        comm.fail(moecomm.MoeCommError("rank 0 checked its peers alone: the checks are out of step"))
    from mpi4py import MPI
    everyone = MPI.COMM_WORLD.allgather(fails)
    comm.finalize()  # broken on every rank: local
    if comm.rank == 0:
        for f in sum(everyone, []):
            print("FAIL", f)
        print(f"peer check on {len(everyone)} ranks: {len(sum(everyone, []))} failures; "
              f"check_peers(64 KiB) {per * 1e6:.0f} us per call (host round trip included)")
    sys.exit(1 if any(everyone) else 0)


if __name__ == "__main__":
    main()
