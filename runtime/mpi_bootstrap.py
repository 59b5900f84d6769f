"""Rank discovery under an MPI launcher (mpirun, mpiexec, srun --mpi=pmix), as DeepSpeed's
`mpi_discovery` does it: MPI knows the ranks, and the rendezvous' endpoint is rank 0's to name.

Why not the launcher's environment alone: it gives a rank its number but no address for
torch.distributed's rendezvous, and every rank taking 127.0.0.1 works on one node only. So the
ranks all-gather their host names (a rank's local rank is its place among the ranks of its host)
and rank 0 broadcasts its endpoint: MASTER_ADDR and MASTER_PORT where the user set them, else its
host name resolved to an address and a port free there.

Imported only under an MPI launcher: importing mpi4py initialises MPI (seconds without a launcher,
and a second runtime beside torchrun's). The calls go through ProfiledComm into the caller's
CallLog, as the stage's profiler starts only after the process group exists.
"""

from __future__ import annotations

import ipaddress
import socket

from runtime.dist import RankInfo
from runtime.group import free_port
from runtime.mpi_profiler import ProfiledComm


def mpi_rendezvous(env, calls=None) -> tuple[RankInfo, tuple[str, int]]:
    """This rank as MPI's world sees it, and the master (address, port) every rank agreed on.
    `calls`: the CallLog the two collectives are recorded in (unrecorded without one)."""
    from mpi4py import MPI

    comm = ProfiledComm(MPI.COMM_WORLD, recorder=calls)
    rank, size = comm.Get_rank(), comm.Get_size()
    hosts = comm.allgather(socket.gethostname())
    addr, port = comm.bcast(master_endpoint(env) if rank == 0 else None, root=0)
    check_reachable(addr, hosts)
    # MPI's part ends here. Finalised, a rank that later leaves without the interpreter's finalisation
    # (os._exit after a preemption's checkpoint) is not a lost PMIx connection, on which Slurm cancels
    # the step and SIGKILLs the ranks still tearing down (a rank in a container takes seconds).
    MPI.Finalize()
    return RankInfo(rank, size, local_rank(hosts, rank), "mpi"), (addr, port)


def master_endpoint(env) -> tuple[str, int]:
    """Rank 0's choice: MASTER_ADDR and MASTER_PORT where set, else this host's address and a port
    the OS finds free (a fixed default would collide with another job's rendezvous on the node)."""
    return env.get("MASTER_ADDR") or host_address(), int(env.get("MASTER_PORT") or free_port())


def host_address() -> str:
    """This host's name resolved to an IPv4 address, one that is not loopback where it has one
    (Debian's /etc/hosts maps the host name to 127.0.1.1)."""
    found = [a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    return next((a for a in found if not is_loopback(a)), found[0])


def is_loopback(addr: str) -> bool:
    """Whether an address (IPv4 or IPv6) or a host name (resolved) is this machine's loopback."""
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:  # a host name, e.g. a MASTER_ADDR the user set
        return ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback


def local_rank(hosts: list[str], rank: int) -> int:
    """The rank's place among the ranks on its host (hosts: every rank's host name, by rank)."""
    return hosts[:rank].count(hosts[rank])


def check_reachable(addr: str, hosts: list[str]) -> None:
    """Refuse a loopback master address for ranks on several hosts: their rendezvous would wait
    until it timed out. Every rank checks, so that all of them stop."""
    spanned = len(set(hosts))
    if spanned > 1 and is_loopback(addr):
        raise RuntimeError(
            f"the master address {addr} (rank 0's host name resolved) is a loopback address, but the "
            f"ranks run on {spanned} hosts: set MASTER_ADDR to an address of rank 0's host that the "
            "others reach (mpirun -x MASTER_ADDR=...)"
        )
