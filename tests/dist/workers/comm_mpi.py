"""Worker (under mpirun): the mpi4py calls the pipeline makes, through ProfiledComm, each in a
phase named after it."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from runtime.comm_profiler import CommProfiler
from runtime.mpi_profiler import ProfiledComm
from runtime.phases import phase

N = 1000  # float64 elements: 8000 bytes


def main(out_dir: str) -> None:
    comm = ProfiledComm(MPI.COMM_WORLD)
    rank, size = comm.Get_rank(), comm.Get_size()
    x, out = np.ones(N), np.empty(N)
    calls = {
        "Allreduce": lambda: comm.Allreduce(x, out, op=MPI.SUM),
        "Allreduce_in_place": lambda: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM),
        "Bcast": lambda: comm.Bcast(x, root=0),
        "Allgather": lambda: comm.Allgather(x, np.empty(N * size)),
        "Gather": lambda: comm.Gather(x, np.empty(N * size) if rank == 0 else None, root=0),
        "Send_Recv": lambda: comm.Send(x, dest=1) if rank == 0 else comm.Recv(out, source=0),
        "Barrier": lambda: comm.Barrier(),
        "bcast_object": lambda: comm.bcast({"master": "10.0.0.1:29500"}, root=0),
        "allgather_object": lambda: comm.allgather("x" * (rank + 1)),  # pieces of unlike sizes
    }
    with CommProfiler(Path(out_dir), "mpi", rank):
        for name, call in calls.items():
            with phase(name):
                call()


if __name__ == "__main__":
    main(sys.argv[1])
