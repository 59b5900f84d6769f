"""`python -m launch.task_guard CMD...`: CMD inside a podman container, ended when its srun task ends.

podman's client is the srun task, but the container's processes are conmon's children, outside the
task's process group: a step killed outright (scancel, srun --kill-on-bad-exit after a failed rank,
the end of a job's Ray steps) would kill the client only and leave ranks training, or Ray holding its
ports, on the node. The guard is the container's first process: it passes on the signals podman's
proxy brings (USR1 for the requeue, TERM, INT), and once the task (SLURM_TASK_PID, which podman's
--env-host carries in) is gone it ends CMD: SIGTERM, then SIGKILL to its process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

FORWARDED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it exists
        pass
    return True


def guard(command: list[str], task_pid: int, poll_s: float = 0.5, grace_s: float = 10.0) -> int:
    """CMD's exit code (128 + signal where a signal ended it)."""
    child = subprocess.Popen(command, start_new_session=True)  # a group of its own, to end it whole
    for sig in FORWARDED:
        signal.signal(sig, lambda received, _frame: child.send_signal(received))
    while True:
        try:
            code = child.wait(timeout=poll_s)
            return code if code >= 0 else 128 - code
        except subprocess.TimeoutExpired:
            pass
        if not alive(task_pid):
            break
    child.terminate()
    try:
        child.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(child.pid, signal.SIGKILL)  # what it started too
    except ProcessLookupError:
        pass
    return 128 + signal.SIGKILL


def main(argv: list[str]) -> int:
    task = os.environ.get("SLURM_TASK_PID")
    if not argv or not task:
        print("usage: SLURM_TASK_PID=PID python -m launch.task_guard CMD...", file=sys.stderr)
        return 2
    return guard(argv, int(task))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
