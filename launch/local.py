"""Running one stage on this machine: torchrun with N ranks of launch.worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from core.rundir import RunDir
from runtime.dist import free_port
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


def repo_env() -> dict[str, str]:
    """This environment with the repository importable by the rank processes."""
    env = dict(os.environ)
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    return env


def run_stage_locally(run_dir: Path, stage_id: str, nproc: int, pass_fds: tuple[int, ...] = ()) -> int:
    """Runs the stage to completion; returns torchrun's exit code. Rank logs go to <stage>/logs/.
    `pass_fds`: descriptors torchrun inherits (the run directory's lock)."""
    env = repo_env()
    # One intra-op thread pool per rank sized to its share of the cores: oversubscription
    # (every rank using every core) makes gloo collectives and matmuls crawl.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return run_forwarding_usr1(torchrun_command(run_dir, stage_id, nproc), env, pass_fds)


def run_forwarding_usr1(command: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> int:
    """Run the stage's launcher (torchrun or srun) to its end, passing a USR1 sent to this process on
    to it: the ranks checkpoint at the next step boundary and exit with PREEMPTED_EXIT."""
    proc = subprocess.Popen(command, env=env, pass_fds=pass_fds)
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: proc.send_signal(signum))
    try:
        return proc.wait()
    finally:
        signal.signal(signal.SIGUSR1, previous)
