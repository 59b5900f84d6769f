"""Running one stage on this machine: N ranks of launch.worker under torchrun, or under mpirun (the
ranks then find each other through MPI: runtime/mpi_bootstrap.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from core.rundir import RunDir
from runtime.group import free_port
from runtime.rank_failure import TORCHRUN_FAILURES


def torchrun_command(run_dir: Path, stage_id: str, nproc: int) -> list[str]:
    failures = RunDir(run_dir).logs(stage_id) / TORCHRUN_FAILURES
    return [
        sys.executable,
        "-m",
        "launch.torchrun",
        str(failures),
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        "-m",
        "launch.worker",
        str(run_dir),
        stage_id,
    ]


def mpirun_command(run_dir: Path, stage_id: str, nproc: int) -> list[str]:
    # --oversubscribe: N ranks whatever the cores, as torchrun starts them; -x: the variables a rank
    # needs that mpirun hands only to the ranks on its own node otherwise.
    return [
        "mpirun",
        "--oversubscribe",
        "-np",
        str(nproc),
        "-x",
        "PYTHONPATH",
        "-x",
        "OMP_NUM_THREADS",
        sys.executable,
        "-m",
        "launch.worker",
        str(run_dir),
        stage_id,
    ]


LAUNCHERS = {"torchrun": torchrun_command, "mpirun": mpirun_command}


def repo_env() -> dict[str, str]:
    """This environment with the repository importable by the rank processes."""
    env = dict(os.environ)
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    return env


def run_stage_locally(
    run_dir: Path, stage_id: str, nproc: int, pass_fds: tuple[int, ...] = (), launcher: str = "torchrun"
) -> int:
    """Runs the stage to completion; returns the launcher's exit code (a key of LAUNCHERS). Rank logs go
    to <stage>/logs/. `pass_fds`: descriptors the launcher inherits (the run directory's lock)."""
    return run_forwarding_usr1(LAUNCHERS[launcher](run_dir, stage_id, nproc), rank_env(nproc), pass_fds)


def rank_env(nproc: int) -> dict[str, str]:
    """repo_env, with one intra-op thread pool per rank sized to its share of the cores (unless set):
    oversubscription (every rank using every core) makes gloo collectives and matmuls crawl."""
    env = repo_env()
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


def run_forwarding_usr1(command: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> int:
    """Run the stage's launcher (torchrun or srun) to its end, passing a USR1 sent to this process on
    to it: the ranks checkpoint at the next step boundary and exit with PREEMPTED_EXIT."""
    proc = subprocess.Popen(command, env=env, pass_fds=pass_fds)
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: proc.send_signal(signum))
    try:
        return proc.wait()
    finally:
        signal.signal(signal.SIGUSR1, previous)
