"""The two prctl(2) requests the ranks' processes make (no-ops off Linux)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

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
