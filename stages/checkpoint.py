"""Step checkpoints: ckpt/step-000120/, written under a temporary name and renamed when complete,
with a checksums.json (each file's sha256 per 64 MiB piece, and its size and modification time)
that resume verifies: a file whose stat is the sealed one is trusted, the others are read again,
the ranks hashing its pieces first come first served. A checkpoint that fails verification is skipped with a
warning and the previous one is used; only the newest `keep` valid ones are retained.

The engine writes its own (sharded) files into the directory it is given; this module only names,
seals, verifies and prunes, and turns a full disk into one clear error that leaves the previous
checkpoints as they were.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import logging
import os
import shutil
import traceback
from pathlib import Path

from core.atomic import atomic_write_text
from core.digests import (
    CHUNK_BYTES,
    file_digests,
    file_stats,
    hash_piece,
    hash_pieces,
    pieces_of,
    stat_of,
)
from runtime.group import claimed, from_rank0, joined_group

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
        """Digest the staged files and rename the directory into place. Every rank calls it once its
        engine has saved: the ranks hash the files' pieces first come first served, so the
        collectives here wait for at most one piece's hashing, whatever the size."""
        staging, final = self.staging(step), self.root / step_name(step)
        rank = _rank_world()[0]
        _barrier()  # every rank's files are written
        stats = from_rank0(lambda: file_stats(staging, skip=frozenset({CHECKSUMS})))
        sizes = {rel: size for rel, (size, _mtime) in stats.items()}
        mine = hash_pieces(staging, _claim(pieces_of(sizes, CHUNK_BYTES)), CHUNK_BYTES)
        moved = sorted(rel for rel, _offset, _length in mine if stat_of(staging / rel) != stats[rel])
        hashed, moved = _merge_all(mine, moved)
        if moved:
            raise CheckpointWriteError(f"{', '.join(moved[:3])} changed while {staging} was being sealed")
        if rank == 0:
            files = {rel: {"stat": stats[rel], "sha256": shas} for rel, shas in file_digests(hashed).items()}
            record = {"format": 2, "chunk_bytes": CHUNK_BYTES, "files": files}
            atomic_write_text(staging / CHECKSUMS, json.dumps(record, indent=1))
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)
            self._prune()
        self._verified.add(step)
        _barrier()  # sealed before any rank goes on (or leaves for a requeue)
        return final

    def sealed_steps(self) -> list[int]:
        return sorted(int(p.name.split("-")[1]) for p in self.root.glob("step-*") if p.is_dir())

    def newest_valid(self) -> int | None:
        return self.survey()[0]

    def survey(self, steps: list[int] | None = None, want: int = 1) -> tuple[int | None, dict[str, str]]:
        """The newest checkpoint that verifies, and why each newer one was skipped; goes on until
        `want` verify (those retention keeps). With torch.distributed initialised every rank calls it
        with the same `steps` and checks a share of each."""
        skipped: dict[str, str] = {}
        valid = []
        for step in reversed(self.sealed_steps() if steps is None else steps):
            problem = self.verify(step)
            if problem is None:
                valid.append(step)
                if len(valid) == want:
                    break
                continue
            log.warning("checkpoint %s is unusable (%s); trying the previous one", step_name(step), problem)
            skipped[step_name(step)] = problem
        return (valid[0] if valid else None), skipped

    def verify(self, step: int, rehash: bool = False, trust_only: bool = False) -> str | None:
        """None if the checkpoint's files are those sealed. A file whose size and modification time
        are the sealed ones is trusted; the others (every file with `rehash`, or in an old
        checksums.json without stats) are read again, the ranks sharing the pieces, and their stats
        recorded once they match. `trust_only`: such a file is a problem, nothing is read."""
        path = self.root / step_name(step)
        now = from_rank0(lambda: file_stats(path, skip=frozenset({CHECKSUMS})))
        try:
            record = read_record(path / CHECKSUMS)
        except (OSError, ValueError) as e:
            problem, stale = _agree(f"no readable {CHECKSUMS}: {e}", {})
        else:
            problem, stale = _agree(*_check_share(path, record, now, rehash, trust_only, _claim))
        if problem is None:
            if stale and _rank_world()[0] == 0:
                _restamp(path, record, stale)
            self._verified.add(step)
        return problem

    def digests(self) -> dict[str, str]:
        """One value per sealed checkpoint that pins the content of all its files (not their stats)."""
        digests = {}
        for s in self.sealed_steps():
            with contextlib.suppress(OSError, ValueError):
                files = read_record(self.root / step_name(s) / CHECKSUMS)["files"]
                content = {rel: entry["sha256"] for rel, entry in files.items()}
                digests[step_name(s)] = hashlib.sha256(
                    json.dumps(content, sort_keys=True).encode()
                ).hexdigest()
        return digests

    def _prune(self) -> None:
        """Keep the newest `keep` checkpoints that verify; a corrupted one never counts as kept.
        Those not verified by this process are judged by their stats alone (resume verified the
        newest `keep`), so retention never reads a checkpoint."""
        kept = 0
        for step in reversed(self.sealed_steps()):
            if kept < self.keep and (step in self._verified or self._trusted(step)):
                kept += 1
                continue
            shutil.rmtree(self.root / step_name(step), ignore_errors=True)
        for stale in self.root.glob(".step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)

    def _trusted(self, step: int) -> bool:
        try:
            record = read_record(self.root / step_name(step) / CHECKSUMS)
        except (OSError, ValueError):
            return False
        path = self.root / step_name(step)
        now = file_stats(path, skip=frozenset({CHECKSUMS}))
        return _check_share(path, record, now, rehash=False, trust_only=True, claim=None)[0] is None


def read_record(path: Path) -> dict:
    """checksums.json as {"format": 2, "chunk_bytes", "files": {path: {"stat", "sha256": [...]}}};
    the old format ({path: sha256}) reads as whole-file digests without stats."""
    record = json.loads(path.read_text())
    if record.get("format") == 2:
        return record
    if not all(isinstance(sha, str) for sha in record.values()):
        raise ValueError(f"{path} is neither format 2 nor a map of file to sha256")
    return {
        "format": 2,
        "chunk_bytes": 0,
        "files": {rel: {"stat": None, "sha256": [sha]} for rel, sha in record.items()},
    }


def _check_share(
    path: Path, record: dict, now: dict[str, list[int]], rehash: bool, trust_only: bool, claim
) -> tuple[str | None, dict]:
    """(this rank's problem, {file: stat} of the files it re-read and found intact); `now` is the
    checkpoint's {file: stat} as rank 0 sees it, so that every rank claims from the same pieces.
    `claim` hands this rank its pieces (None where only stats are compared: trust_only)."""
    files, chunk = record["files"], record["chunk_bytes"]
    wrong = {rel for rel in files.keys() ^ now.keys()}
    wrong |= {
        rel
        for rel in files.keys() & now.keys()
        if files[rel]["stat"] and files[rel]["stat"][0] != now[rel][0]
    }
    stale = {rel for rel in files.keys() & now.keys() - wrong if rehash or files[rel]["stat"] != now[rel]}
    if trust_only and stale:
        return f"changed since it was sealed: {', '.join(sorted(stale)[:3])}", {}
    if wrong:
        return _mismatch(wrong), {}
    mine = []
    for piece in claim(pieces_of({rel: now[rel][0] for rel in stale}, chunk)) if stale else ():
        mine.append(piece)
        rel, offset, _length = piece
        expected = files[rel]["sha256"]
        index = offset // chunk if chunk else 0
        if index >= len(expected) or hash_piece(path, piece, chunk) != expected[index]:
            wrong.add(rel)
    return (_mismatch(wrong) if wrong else None), {rel: now[rel] for rel, _o, _l in mine}


def _mismatch(files: set[str]) -> str:
    return f"checksum mismatch in {', '.join(sorted(files)[:3])}"


def _restamp(path: Path, record: dict, stats: dict[str, list[int]]) -> None:
    """Record the stats of files whose content was verified again (a copied run directory, an old
    checksums.json): the next verification trusts them without reading."""
    for rel, stat in stats.items():
        record["files"][rel]["stat"] = stat
    atomic_write_text(path / CHECKSUMS, json.dumps(record, indent=1))


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
    """The newest checkpoint every rank agrees is valid: each checks its share of each candidate's
    files (and of the older ones retention will keep, so that it never needs to read them)."""
    steps = from_rank0(ckpts.sealed_steps)
    return ckpts.survey(steps, want=max(ckpts.keep, 1))[0]


def _rank_world() -> tuple[int, int]:
    dist = joined_group()
    return (dist.get_rank(), dist.get_world_size()) if dist is not None else (0, 1)


# Every rank seals and verifies the same checkpoints in the same order, so the n-th hand-out has
# the same key everywhere.
_HAND_OUTS = itertools.count()


def _claim(pieces: list):
    """This rank's pieces, largest first, each claimed through the process group's store when the
    rank is ready to hash it (an iterator: consume it as you hash)."""
    key = f"hpcr1/checkpoint-pieces/{next(_HAND_OUTS)}"
    return claimed(sorted(pieces, key=lambda p: (-p[2], p[0], p[1])), key)


def _barrier() -> None:
    dist = joined_group()
    if dist is not None:
        dist.barrier()


def _all(value) -> list:
    dist = joined_group()
    if dist is None:
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _agree(problem: str | None, stale: dict) -> tuple[str | None, dict]:
    """Every rank's verdict on its share, on every rank: the first problem, and all re-read stats."""
    verdicts = _all((problem, stale))
    problems = [p for p, _s in verdicts if p is not None]
    return (problems[0] if problems else None), {rel: st for _p, s in verdicts for rel, st in s.items()}


def _merge_all(mine: dict, moved: list[str]) -> tuple[dict, list[str]]:
    """The pieces every rank hashed, and the files any saw change meanwhile."""
    merged, changed = {}, set()
    for hashed, moved_there in _all((mine, moved)):
        merged.update(hashed)
        changed.update(moved_there)
    return merged, sorted(changed)
