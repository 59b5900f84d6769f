"""Step checkpoints: ckpt/step-000120/, written under a temporary name and renamed when complete,
with a checksums.json that resume verifies. A checkpoint that fails verification is skipped with a
warning and the previous one is used; only the newest `keep` valid ones are retained.

The engine writes its own (sharded) files into the directory it is given; this module only names,
seals, verifies and prunes, and turns a full disk into one clear error that leaves the previous
checkpoints as they were.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import traceback
from pathlib import Path

import torch.distributed as dist

from core.atomic import atomic_write_text, file_sha256, tree_checksums

log = logging.getLogger(__name__)
CHECKSUMS = "checksums.json"
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# torch.save reports a failed write as a RuntimeError from its C++ zip writer, without an errno
# ("file write failed", "unexpected pos 704 vs 598"): the message alone cannot tell a full disk.
DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded")


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (typically a full disk); the older ones are untouched."""


def step_name(step: int) -> str:
    return f"step-{step:06d}"


class CheckpointDir:
    def __init__(self, root: Path, keep: int):
        self.root, self.keep = Path(root), keep
        # Steps that passed verification in this process: retention re-hashes each at most once.
        self._verified: set[int] = set()

    def staging(self, step: int) -> Path:
        """Where the engine writes step `step` before it is sealed."""
        return self.root / f".{step_name(step)}.tmp"

    @contextlib.contextmanager
    def writing(self, step: int):
        """Yields the staging directory; if writing into it fails, removes it (giving back the
        space) and raises CheckpointWriteError saying why and which checkpoint is still there."""
        staging = self.staging(step)
        try:
            yield staging
        except Exception as e:
            # The failed writer's open files live on in the traceback's frames; a deleted but open
            # file keeps its space, so close them before removing the partial checkpoint.
            _close_frames(e)
            full = _is_disk_full(e, self.root)
            shutil.rmtree(staging, ignore_errors=True)
            raise CheckpointWriteError(self._write_failure(step, e, full)) from e

    def _write_failure(self, step: int, error: Exception, disk_full: bool) -> str:
        usable = [s for s in self.sealed_steps() if s != step]
        kept = f"{step_name(usable[-1])} is still there" if usable else "there is no earlier checkpoint"
        disk = shutil.disk_usage(_existing(self.root))
        what = "no space left on device" if disk_full else f"{type(error).__name__}: {error}"
        return (
            f"writing checkpoint {step_name(step)} into {self.root} failed: {what} "
            f"({disk.free / 2**20:.1f} of {disk.total / 2**20:.1f} MiB free there after removing the "
            f"partial write); {kept}"
        )

    def seal(self, step: int) -> Path:
        """Checksum the staged files and rename the directory into place (rank 0, after a barrier)."""
        staging, final = self.staging(step), self.root / step_name(step)
        atomic_write_text(staging / CHECKSUMS, json.dumps(tree_checksums(staging), indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        self._verified.add(step)
        self._prune()
        return final

    def sealed_steps(self) -> list[int]:
        return sorted(int(p.name.split("-")[1]) for p in self.root.glob("step-*") if p.is_dir())

    def newest_valid(self) -> int | None:
        return self.survey()[0]

    def survey(self) -> tuple[int | None, dict[str, str]]:
        """The newest checkpoint that verifies, and why each newer one was skipped."""
        skipped: dict[str, str] = {}
        for step in reversed(self.sealed_steps()):
            problem = self.verify(step)
            if problem is None:
                return step, skipped
            log.warning("checkpoint %s is unusable (%s); trying the previous one", step_name(step), problem)
            skipped[step_name(step)] = problem
        return None, skipped

    def verify(self, step: int) -> str | None:
        path = self.root / step_name(step)
        try:
            expected = json.loads((path / CHECKSUMS).read_text())
        except (OSError, ValueError) as e:
            return f"no readable {CHECKSUMS}: {e}"
        actual = tree_checksums(path)
        actual.pop(CHECKSUMS, None)
        if actual != expected:
            bad = sorted(k for k in expected.keys() | actual.keys() if expected.get(k) != actual.get(k))
            return f"checksum mismatch in {', '.join(bad[:3])}"
        self._verified.add(step)
        return None

    def digests(self) -> dict[str, str]:
        """sha256 of each sealed checkpoint's checksums.json: one value that pins all its files."""
        return {
            step_name(s): file_sha256(self.root / step_name(s) / CHECKSUMS)
            for s in self.sealed_steps()
            if (self.root / step_name(s) / CHECKSUMS).is_file()
        }

    def _prune(self) -> None:
        """Keep the newest `keep` checkpoints that verify; a corrupted one never counts as kept."""
        kept = 0
        for step in reversed(self.sealed_steps()):
            if kept < self.keep and (step in self._verified or self.verify(step) is None):
                kept += 1
                continue
            shutil.rmtree(self.root / step_name(step), ignore_errors=True)
        for stale in self.root.glob(".step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)


def _is_disk_full(error: BaseException | None, root: Path) -> bool:
    """The error says so, or (torch.save says neither) the file system is out of space right now,
    with the partial write still on it."""
    disk = shutil.disk_usage(_existing(root))
    if disk.free < min(64 * 2**20, disk.total // 100):
        return True
    while error is not None:
        if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
            return True
        if any(text in str(error) for text in DISK_FULL_TEXT):
            return True
        error = error.__cause__ or error.__context__
    return False


def _close_frames(error: BaseException | None) -> None:
    """Drop the locals of every frame in the error's chain (torch.save's writer fails once while
    writing and again while closing: two tracebacks, each holding the open file)."""
    while error is not None:
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def _existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def agreed_resume_step(ckpts: CheckpointDir) -> int | None:
    """Rank 0 picks the newest valid checkpoint and every rank resumes from that same one."""
    choice = [ckpts.newest_valid() if not dist.is_initialized() or dist.get_rank() == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    return choice[0]
