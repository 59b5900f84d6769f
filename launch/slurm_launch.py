"""Inside a Slurm allocation: start the stage's ranks with srun (one task per rank, rank/world
from the Slurm env) or with torchrun per node (c10d rendezvous on the first node, through
launch.torchrun); forward USR1 to them. No sleeps: torch.distributed's rendezvous waits for every
rank with its own timeout."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

from core.atomic import atomic_write_text
from core.rundir import RunDir
from launch.container import words_from_env
from launch.local import repo_env, run_forwarding_usr1
from launch.slurm_jobs import base_state
from runtime.rank_failure import LOST_NODES, TORCHRUN_FAILURES


def first_host(nodelist: str) -> str:
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
    )
    return out.stdout.split()[0]


def rendezvous_port(job_id: str) -> int:
    """Derived from the job id, so that two jobs sharing a node pick different ports (unless their
    ids differ by a multiple of 12000); below Linux's ephemeral range (32768 on by default), where
    an outgoing connection may hold the port when rank 0 binds it."""
    return 20000 + int(job_id) % 12000


def srun_command(run_dir: Path, stage_id: str, launcher: str, overlap: bool = False) -> list[str]:
    """`overlap`: the allocation hosts Ray, whose steps hold the CPUs, memory and GPUs the ranks need;
    --overlap shares them all with every other step (srun(1), Slurm 21.08 on; 20.11's shared CPUs only)."""
    worker = ["-m", "launch.worker", str(run_dir), stage_id]
    srun = ["srun", "--overlap"] if overlap else ["srun"]
    container = words_from_env()
    if launcher == "srun":
        return container.wrap([*srun, "--kill-on-bad-exit=1", "--cpu-bind=none"], [sys.executable, *worker])
    nodes = os.environ["SLURM_NNODES"]
    per_node = os.environ["SLURM_NTASKS_PER_NODE"].split("(")[0]
    endpoint = f"{first_host(os.environ['SLURM_JOB_NODELIST'])}:{rendezvous_port(os.environ['SLURM_JOB_ID'])}"
    # Each node's torchrun writes how its ranks failed; the file is per node.
    failures = (
        RunDir(run_dir).logs(stage_id) / f"{os.environ.get('SLURMD_NODENAME', 'node')}-{TORCHRUN_FAILURES}"
    )
    return container.wrap(
        [*srun, "--kill-on-bad-exit=1", "--ntasks-per-node=1"],
        [
            sys.executable,
            "-m",
            "launch.torchrun",
            str(failures),
            f"--nnodes={nodes}",
            f"--nproc-per-node={per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={os.environ['SLURM_JOB_ID']}",
            *worker,
        ],
    )


# What NCCL dlopens for its network plugin when NCCL_NET_PLUGIN is unset; aws-ofi-nccl installs the
# first, its newer releases the second (with the first as a link)
OFI_PLUGIN_NAMES = ("libnccl-net.so", "libnccl-net-ofi.so")


def nccl_plugin_problem() -> str | None:
    """Why NCCL will not start its communicators here, or None. NCCL_NET="AWS Libfabric" (a
    Slingshot profile's) makes a missing aws-ofi-nccl plugin an error at the first collective of
    every rank, after the job has waited in the queue; said before any rank starts. The plugin is
    looked for as NCCL looks for it: dlopen, with this process's environment and library path."""
    if os.environ.get("NCCL_NET") != "AWS Libfabric":
        return None
    plugin = os.environ.get("NCCL_NET_PLUGIN")
    names = (plugin, f"libnccl-net-{plugin}.so") if plugin else OFI_PLUGIN_NAMES
    for name in names:
        try:
            ctypes.CDLL(name)
            return None
        except OSError:
            continue
    return (
        f"NCCL_NET is 'AWS Libfabric' but NCCL's aws-ofi-nccl plugin ({' or '.join(names)}) is not on "
        "this node's library path: load the site's module for it in the cluster profile's `setup` "
        "(or add its lib/ to LD_LIBRARY_PATH in `env`), or unset NCCL_NET to let NCCL fall back to sockets"
    )


def run_stage_in_allocation(
    run_dir: Path, stage_id: str, pass_fds: tuple[int, ...] = (), overlap: bool = False
) -> int:
    """srun's exit code. `pass_fds`: descriptors srun inherits (the run directory's lock); `overlap`:
    the allocation hosts Ray (srun_command)."""
    env = repo_env()
    env.setdefault("MASTER_ADDR", first_host(env["SLURM_JOB_NODELIST"]))
    env.setdefault("MASTER_PORT", str(rendezvous_port(env["SLURM_JOB_ID"])))
    # srun passes USR1 on to every task: a rank, or launch.torchrun, which passes it to its ranks.
    command = srun_command(run_dir, stage_id, env.get("HPCR1_LAUNCHER", "srun"), overlap)
    rc = run_forwarding_usr1(command, env, pass_fds)
    if rc != 0:
        # A rank on a lost node writes nothing: Slurm's view of the job's nodes names it for the error.
        lost = lost_nodes(env["SLURM_JOB_NODELIST"])
        if lost:
            atomic_write_text(RunDir(run_dir).logs(stage_id) / LOST_NODES, json.dumps(lost) + "\n")
    return rc


# Node states (sinfo %T, without flags) of a node the job can no longer use; a "*" suffix on any
# state means the node does not answer the controller.
LOST_STATES = ("down", "drained", "draining", "drain", "fail", "failing", "future", "unknown")


def lost_nodes(nodelist: str) -> dict[str, str]:
    """{node: Slurm's state} for the allocation's nodes that are down or not responding; {} when
    sinfo cannot tell (the failure is then the ranks' own to report)."""
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-n", nodelist, "-o", "%N|%T"], capture_output=True, text=True, check=False
    )
    rows = (line.split("|") for line in out.stdout.splitlines() if line.count("|") == 1)
    return {node: state for node, state in rows if state.endswith("*") or base_state(state) in LOST_STATES}


def requeue_self() -> None:
    """Put this job back in the queue. Slurm lets it start again AuthInfo's cred_expire + 1 s after it
    ends (121 s by default). That hold cannot be lifted from inside the job: a `StartTime=now` sent
    now is overwritten when the requeue completes, after this process has exited."""
    subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True)
