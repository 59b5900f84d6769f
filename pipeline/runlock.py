"""One `hpcr1 run`/`resume`/stage job at a time on a run directory.

An flock on <run>/run.lock, held while the driver lives and by the torchrun it starts (the lock's
file descriptor is passed on), so the kernel releases it however they end, kill -9 included; a
lock left by processes that are gone is free again and simply taken over. The file names the
holder (pid, host, command, start) for the refusal message and is emptied on a clean release, so
finding it non-empty on taking it means the last holder died holding it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path


class RunDirBusy(RuntimeError):
    pass


@contextlib.contextmanager
def hold_run_dir(path: Path, echo=print, wait_s: float = 0.0):
    """Takes the lock file `path` (RunDir.lock), waiting up to `wait_s` for its holder to let go, or
    raises RunDirBusy naming the holder; yields the lock's file descriptor, for child processes that
    must hold it too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, path, echo, time.monotonic() + wait_s)
        previous = _read(fd)
        if previous:
            echo(
                f"hpcr1: note: {path} was left by {_describe(previous)}, "
                "which is no longer running; taking it over"
            )
        _write(
            fd,
            json.dumps(
                {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "command": " ".join(sys.argv),
                    "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                }
            ),
        )
        try:
            yield fd
        finally:
            _write(fd, "")  # any end the driver sees is a clean release; only a kill leaves the name
    finally:
        os.close(fd)  # releases the flock unless a child still holds the descriptor


def holder_after(path: Path, wait_s: float) -> str | None:
    """Waits up to `wait_s` for the run directory to be let go; returns who still holds it then, or
    None once it is free (or where the file system cannot lock: nothing holds it then). It takes
    nothing: the lock is released at once."""
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDWR)
    try:
        return None if _flock_by(fd, time.monotonic() + wait_s) else _holder(fd)
    except OSError:
        return None
    finally:
        os.close(fd)


def _acquire(fd: int, path: Path, echo, deadline: float) -> None:
    try:
        if not _flock_by(fd, deadline):
            raise RunDirBusy(
                f"run directory {path.parent} is in use by {_holder(fd)}, or by the ranks it started; "
                f"wait for it to end or stop it, then run again"
            )
    except OSError as e:
        # Some parallel file systems are mounted without lock support: run, but say what is lost.
        echo(
            f"hpcr1: warning: cannot lock {path} ({e.strerror}); a second run on this directory "
            f"would not be refused"
        )


def _flock_by(fd: int, deadline: float) -> bool:
    """Takes the flock, retrying until `deadline`; False if it is still held then."""
    while not _try_flock(fd):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _holder(fd: int) -> str:
    holder = _read(fd)
    return _describe(holder) if holder else "another process (it has not written its name yet)"


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _describe(holder: str) -> str:
    try:
        h = json.loads(holder)
        return f"pid {h['pid']} on {h['host']} (`{h['command']}`, since {h['since']})"
    except (ValueError, KeyError, TypeError):
        return f"an unknown process ({holder[:100]!r})"


def _read(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode(errors="replace").strip()


def _write(fd: int, text: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)
    os.fsync(fd)
