"""Step checkpoints: ckpt/step-000120/, written under a temporary name and renamed when complete,
with a checksums.json that resume verifies. A checkpoint that fails verification is skipped with a
warning and the previous one is used; only the newest `keep` are retained.

The engine writes its own (sharded) files into the directory it is given; this module only names,
seals, verifies and prunes.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch.distributed as dist

from pipeline.atomic import atomic_write_text, tree_checksums

log = logging.getLogger(__name__)
CHECKSUMS = "checksums.json"


def step_name(step: int) -> str:
    return f"step-{step:06d}"


class CheckpointDir:
    def __init__(self, root: Path, keep: int):
        self.root, self.keep = Path(root), keep

    def staging(self, step: int) -> Path:
        """Where the engine writes step `step` before it is sealed."""
        return self.root / f".{step_name(step)}.tmp"

    def seal(self, step: int) -> Path:
        """Checksum the staged files and rename the directory into place (rank 0, after a barrier)."""
        staging, final = self.staging(step), self.root / step_name(step)
        atomic_write_text(staging / CHECKSUMS, json.dumps(tree_checksums(staging), indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        self._prune()
        return final

    def sealed_steps(self) -> list[int]:
        return sorted(int(p.name.split("-")[1]) for p in self.root.glob("step-*") if p.is_dir())

    def newest_valid(self) -> int | None:
        for step in reversed(self.sealed_steps()):
            problem = self.verify(step)
            if problem is None:
                return step
            log.warning("checkpoint %s is unusable (%s); trying the previous one", step_name(step), problem)
        return None

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
        return None

    def _prune(self) -> None:
        for step in self.sealed_steps()[: -self.keep]:
            shutil.rmtree(self.root / step_name(step), ignore_errors=True)
        for stale in self.root.glob(".step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)


def agreed_resume_step(ckpts: CheckpointDir) -> int | None:
    """Rank 0 picks the newest valid checkpoint and every rank resumes from that same one."""
    choice = [ckpts.newest_valid() if not dist.is_initialized() or dist.get_rank() == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    return choice[0]
