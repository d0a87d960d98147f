"""The ending every MPI test program shares: rank 0 prints each rank's failures and the count line the
pytest wrappers look for; the exit status says whether any rank failed."""


REPORT_ENV = "MOECOMM_TEST_REPORT"  # a file rank 0 also writes its report to (conftest.run_mpi sets it)


def report(everyone, checks, ranks, rank):
    """``everyone``: every rank's list of failures (gathered); prints on rank 0, and writes the same lines to
    ``$MOECOMM_TEST_REPORT`` when set (a launcher may drop the output of a process that ends without MPI's
    finalization, as one whose communicator broke does); returns the exit status."""
    if rank == 0:
        import os
        lines = [f"FAIL {f}" for f in sum(everyone, [])]
        lines.append(f"{checks} checks on {ranks} ranks: {len(sum(everyone, []))} failures")
        print("\n".join(lines), flush=True)
        if os.environ.get(REPORT_ENV):
            with open(os.environ[REPORT_ENV], "w") as f:
                f.write("\n".join(lines) + "\n")
    return 1 if any(everyone) else 0


def finish(comm, fails, checks):
    """Gather every rank's failures over the communicator, finalize it, report, and exit with the status."""
    import sys
    everyone = comm.allgather(fails)
    comm.finalize()
    sys.exit(report(everyone, checks, comm.world_size, comm.rank))
