"""Checks of where a run will go, before anything is queued: each a PASS, WARN or FAIL row with its
fix in one line. `hpcr1 submit` runs those that need no job and refuses on a FAIL (--skip-checks
submits anyway)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from analysis.disk import StageDisk

# Below this share of room beyond the planned bytes the check warns: logs, communication profiles,
# wandb and the caches want some too.
DISK_HEADROOM = 1.25


@dataclass(frozen=True)
class Check:
    name: str
    verdict: str
    """PASS, WARN or FAIL."""
    detail: str
    fix: str = ""

    def line(self) -> str:
        return f"{self.verdict:<4}  {self.name}: {self.detail}" + (f" -> {self.fix}" if self.fix else "")


def disk_check(run_root: Path, planned: list[StageDisk]) -> Check:
    """The run directory's file system against the bytes and files the stages still to run write."""
    where = existing_ancestor(run_root)
    if not planned:
        return Check("run directory space", "PASS", "every stage is done: nothing more to write")
    fs = os.statvfs(where)
    free, need = fs.f_bavail * fs.f_frsize, sum(s.total_bytes for s in planned)
    files, free_files = sum(s.files for s in planned), fs.f_favail
    largest = max(planned, key=lambda s: s.total_bytes)
    most = f"{largest.stage} {gib(largest.total_bytes)} the most"
    detail = f"{gib(need)} planned ({most}), {gib(free)} free on {where}"
    fix = "free space there, lower keep_checkpoints, or --run-dir on a larger file system"
    if free < need:
        return Check("run directory space", "FAIL", detail, fix)
    if fs.f_files and free_files < files:  # f_files 0: the file system counts no inodes (btrfs)
        detail = f"{files} files planned, {free_files} inodes free on {where}"
        return Check("run directory inodes", "FAIL", detail, "free inodes there, or --run-dir elsewhere")
    if free < DISK_HEADROOM * need:
        return Check("run directory space", "WARN", detail + ": little room for logs and profiles", fix)
    return Check("run directory space", "PASS", detail)


def existing_ancestor(path: Path) -> Path:
    """`path`, or the nearest of its parents that exists: where the run directory will be made."""
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
