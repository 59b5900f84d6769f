"""launch/task_guard.py, the first process of a podman container a job step runs: it passes on the
signals podman's proxy brings, returns its command's exit code, and ends the command (and what the
command started) once the srun task that stands for it, podman's client, is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO
from tests.unit.test_run_lock import wait_gone

# A command that records the signals it gets and starts a grandchild that would outlive it.
CHILD = """
import pathlib, signal, subprocess, sys, time
out = pathlib.Path(sys.argv[1])
signal.signal(signal.SIGUSR1, lambda *_: out.with_suffix(".usr1").write_text("got"))
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
out.write_text(str(grandchild.pid))
time.sleep(float(sys.argv[2]))
sys.exit(7)
"""


def start_guard(tmp_path: Path, task_pid: int, runs_s: float) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / "child.txt"
    guard = subprocess.Popen(
        [sys.executable, "-m", "launch.task_guard", sys.executable, "-c", CHILD, str(out), str(runs_s)],
        cwd=REPO,
        env={**os.environ, "SLURM_TASK_PID": str(task_pid)},
    )
    deadline = time.monotonic() + 30
    while not out.exists() or not out.read_text():
        assert time.monotonic() < deadline and guard.poll() is None, "the command never started"
        time.sleep(0.05)
    return guard, out


def test_the_guard_passes_usr1_on_and_returns_the_commands_exit_code(tmp_path):
    guard, out = start_guard(tmp_path, os.getpid(), runs_s=3)
    guard.send_signal(signal.SIGUSR1)
    assert guard.wait(timeout=30) == 7
    assert out.with_suffix(".usr1").read_text() == "got"
    os.kill(int(out.read_text()), signal.SIGKILL)


def test_the_command_and_what_it_started_end_when_the_task_is_gone(tmp_path):
    task = subprocess.Popen(["sleep", "600"])  # stands for podman's client, the srun task
    guard, out = start_guard(tmp_path, task.pid, runs_s=600)
    grandchild = int(out.read_text())
    task.kill()
    task.wait()
    assert guard.wait(timeout=30) == 128 + signal.SIGKILL
    wait_gone(grandchild)  # the command's own child, too
