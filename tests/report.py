"""The ending every MPI test program shares: rank 0 prints each rank's failures and the count line the
pytest wrappers look for; the exit status says whether any rank failed."""


def report(everyone, checks, ranks, rank):
    """``everyone``: every rank's list of failures (gathered); prints on rank 0; returns the exit status."""
    if rank == 0:
        for f in sum(everyone, []):
            print("FAIL", f)
        print(f"{checks} checks on {ranks} ranks: {len(sum(everyone, []))} failures", flush=True)
    return 1 if any(everyone) else 0


def finish(comm, fails, checks):
    """Gather every rank's failures over the communicator, finalize it, report, and exit with the status."""
    import sys
    everyone = comm.allgather(fails)
    comm.finalize()
    sys.exit(report(everyone, checks, comm.world_size, comm.rank))
