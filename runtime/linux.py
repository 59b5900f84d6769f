"""What the ranks' processes ask of Linux: two prctl(2) requests (no-ops off Linux), and which
container, if any, they run in."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path

PR_SET_PDEATHSIG = 1
PR_SET_PTRACER = 0x59616D61  # Yama's


def _prctl(option: int, arg: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (at once if it already has)."""
    parent = os.getppid()
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the request was made
        os.kill(os.getpid(), signal.SIGKILL)


def let_trace(pid: int) -> None:
    """Let process `pid` read this one (py-spy) where Yama allows ptrace of descendants only
    (ptrace_scope 1, common on clusters)."""
    _prctl(PR_SET_PTRACER, pid)


def container_here() -> str:
    """The container this process runs in, as its runtime marks it from inside, or 'none'."""
    for variable in ("APPTAINER_CONTAINER", "SINGULARITY_CONTAINER"):
        if os.environ.get(variable):
            return f"{variable.split('_')[0].lower()} {os.environ[variable]}"
    if Path("/run/.containerenv").exists():  # podman's, in every container it starts
        return "podman"
    return os.environ.get("container") or "none"  # systemd's convention, kept by enroot and others
