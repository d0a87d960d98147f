"""moecomm started from a torch.distributed process group under torchrun, with no MPI in the process:

    torchrun --nproc-per-node 2 tests/torchrun_bootstrap.py

A dispatch and combine with torch tensors checked against the reference on every rank, and a peer check.
Prints "<n> checks on <w> ranks: <f> failures" on rank 0.
"""
import sys

import torch
import torch.distributed as dist

import moecomm
from mpi_embedding import H, K, M, data, run_layer


def main():
    dist.init_process_group("gloo")
    comm = moecomm.init(comm=dist.group.WORLD)
    fails = []
    if comm.mpi is not None or "mpi4py.MPI" in sys.modules:
        fails.append("MPI was used under torchrun")
    torch.cuda.set_device(comm.device)
    a2a = moecomm.AllToAll(comm, M, 4 * comm.world_size, K, H, None, "bfloat16", "bfloat16")
    for seed in range(3):
        d = data(comm.world_size, seed)
        x = torch.from_numpy(d[0][comm.rank].view("uint16").copy()).cuda().view(torch.bfloat16)
        fails += run_layer(comm, a2a, x, d[1][comm.rank], d[2][comm.rank], None, d, f"seed {seed}")
    comm.check_peers()
    a2a.destroy()
    everyone = comm.allgather(fails)
    comm.finalize()
    if comm.rank == 0:
        for f in sum(everyone, []):
            print("FAIL", f)
        print(f"4 checks on {comm.world_size} ranks: {len(sum(everyone, []))} failures")
    dist.destroy_process_group()
    sys.exit(1 if any(everyone) else 0)


if __name__ == "__main__":
    main()
