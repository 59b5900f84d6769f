"""Rank and world discovery, and process-group initialisation.

Ranks come from torchrun's env, then Slurm's (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID), then an MPI
launcher's (Open MPI's OMPI_COMM_WORLD_*, MPICH's PMI_*), in that order (docs/design.md, Processes).
Under an MPI launcher (mpirun, mpiexec, srun --mpi=pmix) without torchrun, init_distributed asks MPI
instead (runtime/mpi_bootstrap.py): the environment gives no address for the rendezvous.

One device per rank: the machine's accelerator (torch.accelerator: CUDA, or any device registered
as PyTorch's accelerator) at the rank's local index, else the CPU. The default group uses that
device's backend alone (nccl on CUDA, gloo on the CPU), so every tensor that enters a collective
must be on `rank_device()`: docs/design.md, Devices, says why there is no CPU side group.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from core.cluster import COLLECTIVE_TIMEOUT_ENV


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    source: str  # which environment the ranks came from: torchrun, slurm, mpi, single


# (rank, size, local rank) variables of the MPI launchers: Open MPI's mpirun, MPICH's (hydra) mpiexec.
MPI_RANK_ENVS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
)
# Set for every rank an MPI launcher starts; PMIx's (srun --mpi=pmix) has no size beside it.
MPI_LAUNCHED_BY = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")


def discover_ranks(env: dict[str, str] | None = None) -> RankInfo:
    """The ranks as the launcher's environment tells them, without starting anything (the worker
    names its log by this rank before it joins the group)."""
    env = os.environ if env is None else env
    if under_torchrun(env):
        return RankInfo(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "OMPI_COMM_WORLD_RANK" not in env:
        return RankInfo(
            int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)), "slurm"
        )
    for rank, size, local in MPI_RANK_ENVS:
        if rank in env and size in env:
            return RankInfo(int(env[rank]), int(env[size]), int(env.get(local, 0)), "mpi")
    return RankInfo(0, 1, 0, "single")


def under_torchrun(env: dict[str, str]) -> bool:
    return "RANK" in env and "WORLD_SIZE" in env


def under_mpi(env: dict[str, str]) -> bool:
    """Started by an MPI launcher, and not through torchrun (which an srun task may run)."""
    return not under_torchrun(env) and any(name in env for name in MPI_LAUNCHED_BY)


def accelerator_type() -> str | None:
    """'cuda' on a GPU node (or the type of another registered accelerator); None on a CPU-only one."""
    acc = torch.accelerator.current_accelerator(check_available=True)
    return None if acc is None else acc.type


def rank_device() -> torch.device:
    """The device this rank computes on and its collectives carry: the accelerator index that
    init_distributed selected (its local rank), else the CPU."""
    kind = accelerator_type()
    if kind is None:
        return torch.device("cpu")
    return torch.device(kind, torch.accelerator.current_device_index())


# The ranks that train the stage's model, where not every rank does (a GRPO stage whose rollout has
# ranks of its own): the group its gradients, statistics and checkpoints go over. None: the world.
_training_group: dist.ProcessGroup | None = None


def training_group() -> dist.ProcessGroup | None:
    """The training ranks' group, for the `group` argument of a collective (None: the world)."""
    return _training_group


def set_training_group(group: dist.ProcessGroup | None) -> None:
    global _training_group
    _training_group = group


def release_cached_memory() -> None:
    """Give what freed tensors held back to the device (the caching allocator keeps it otherwise),
    e.g. between training and evaluating on the same GPU."""
    gc.collect()
    if accelerator_type() is not None:
        torch.accelerator.empty_cache()


def device_index(local_rank: int, visible: int) -> int:
    """The rank's device among those it sees: its local rank where it sees the node's every device,
    the only one where the launcher bound one device to each task (`srun --gpus-per-task=1`)."""
    if visible == 1:
        return 0
    if local_rank >= visible:
        raise RuntimeError(
            f"local rank {local_rank} sees {visible} devices: start one rank a device "
            "(tasks per node = GPUs per node), or bind one device to each task"
        )
    return local_rank


def default_backend() -> str:
    return dist.get_default_backend_for_device(accelerator_type() or "cpu")


def init_distributed(backend: str | None = None, mpi_calls=None) -> RankInfo:
    """Initialise the default process group from the discovered ranks (idempotent). `mpi_calls`: where
    the MPI bootstrap's calls are kept for the profiler (a runtime.mpi_profiler.CallLog), if any."""
    if dist.is_initialized():
        return discover_ranks()
    info = rendezvous(mpi_calls)
    if accelerator_type() is not None:
        torch.accelerator.set_device_index(device_index(info.local_rank, torch.accelerator.device_count()))
    timeout = bound_collectives()
    dist.init_process_group(
        backend or default_backend(), rank=info.rank, world_size=info.world_size, timeout=timeout
    )
    return info


def collective_timeout(env: dict[str, str] | None = None) -> timedelta | None:
    """COLLECTIVE_TIMEOUT_ENV's bound on one collective; None where it is unset (torch's defaults).
    Libraries that pass their own timeout to new_group (megatron: 30 min) must be given this one."""
    value = (os.environ if env is None else env).get(COLLECTIVE_TIMEOUT_ENV)
    return timedelta(seconds=float(value)) if value else None


def bound_collectives(env: dict[str, str] | None = None) -> timedelta | None:
    """The collective timeout COLLECTIVE_TIMEOUT_ENV asks for, made the default of every process group
    created from now on: the groups DeepSpeed and megatron make with new_group() take torch's module
    defaults, not the world group's timeout. Without it a rank whose peer's node vanished (or lost its
    link) waits in its collective for torch's default, 30 minutes on gloo, holding the stage."""
    timeout = collective_timeout(env)
    if timeout is None:
        return None
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout
    return timeout


def rendezvous(mpi_calls=None) -> RankInfo:
    """This rank, and the master endpoint in MASTER_ADDR/MASTER_PORT: from MPI under an MPI launcher,
    else from the environment (127.0.0.1:29500 unless set). The ranks also go into torchrun's
    variables, which DeepSpeed and megatron read: under srun or mpirun only ours know them."""
    if under_mpi(os.environ):
        from runtime.mpi_bootstrap import mpi_rendezvous

        info, (addr, port) = mpi_rendezvous(os.environ, mpi_calls)
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
    else:
        info = discover_ranks()
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.update(RANK=str(info.rank), WORLD_SIZE=str(info.world_size), LOCAL_RANK=str(info.local_rank))
    return info


def shutdown_distributed() -> None:
    """Wait for every rank, then destroy the process groups: call it last, outside backward.

    Both halves keep a rank from aborting at exit ("terminate called without an active
    exception"). Without the destroy, DeepSpeed ZeRO-3 bf16 runs sometimes abort. Without the
    barrier, a rank that leaves right after its last backward collective races a gloo worker thread:
    the work it just ran captured backward's thread-local Python context, freeing it needs the GIL,
    and once the interpreter is finalising that thread is killed mid-destructor. Waiting at the
    barrier releases the GIL while the slower ranks finish, so the worker threads are done first.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
