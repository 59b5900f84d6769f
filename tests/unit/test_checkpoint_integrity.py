"""Checkpoint integrity: retention counts only checkpoints that verify, and a write into a full
disk (a real, small tmpfs) fails with one clear error and leaves the previous checkpoint usable."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from core.atomic import atomic_write_text, file_sha256
from core.digests import pieces_of, stat_of
from runtime.group import claimed
from stages.checkpoint import CHECKSUMS, CheckpointDir, CheckpointWriteError, step_name


def _save(ckpts: CheckpointDir, step: int, numel: int) -> None:
    """What an engine does: torch.save its state into the staging directory, then rank 0 seals."""
    with ckpts.writing(step) as staging:
        staging.mkdir(parents=True, exist_ok=True)
        torch.save({"weight": torch.arange(numel, dtype=torch.float32)}, staging / "model.pt")
        ckpts.seal(step)


def _corrupt(root: Path, step: int) -> None:
    path = root / step_name(step) / "model.pt"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # a truncated write


def test_retention_keeps_the_newest_k_valid_checkpoints(tmp_path):
    ckpts = CheckpointDir(tmp_path, keep=2)
    _save(ckpts, 1, 10)
    _save(ckpts, 2, 10)
    _corrupt(tmp_path, 2)
    # A fresh process (a resumed attempt) has verified nothing yet: it must find step 2 corrupt.
    resumed = CheckpointDir(tmp_path, keep=2)
    assert resumed.survey() == (1, {"step-000002": "checksum mismatch in model.pt"})
    _save(resumed, 3, 10)
    # Counting by name would keep 2 and 3 and delete the only good older one, 1.
    assert resumed.sealed_steps() == [1, 3]
    _save(resumed, 4, 10)
    assert resumed.sealed_steps() == [3, 4]


def test_digests_pin_each_sealed_checkpoint(tmp_path):
    ckpts = CheckpointDir(tmp_path, keep=3)
    _save(ckpts, 1, 10)
    _save(ckpts, 2, 20)
    digests = ckpts.digests()
    assert (
        sorted(digests) == ["step-000001", "step-000002"] and digests["step-000001"] != digests["step-000002"]
    )


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs: a real file system that runs out of space."""
    mount = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root / CAP_SYS_ADMIN): {proc.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_full_disk_fails_clearly_and_keeps_the_previous_checkpoint(small_disk):
    ckpts = CheckpointDir(small_disk / "ckpt", keep=2)
    _save(ckpts, 5, 1_000)  # ~4 KB
    with pytest.raises(CheckpointWriteError) as failure:
        _save(ckpts, 10, 1_000_000)  # ~4 MB into 1 MiB
    message = str(failure.value)
    assert "no space left on device" in message and "step-000010" in message, message
    assert "step-000005 is still there" in message, message
    assert list(ckpts.root.iterdir()) == [ckpts.root / "step-000005"], "the partial write must be gone"
    assert CheckpointDir(ckpts.root, keep=2).survey() == (5, {})
    _save(ckpts, 10, 1_000)  # the space came back: the next (smaller) save works
    assert ckpts.sealed_steps() == [5, 10]


def test_full_disk_leaves_the_old_file_and_no_partial_sibling(small_disk):
    target = small_disk / "manifest.json"
    atomic_write_text(target, "old\n")
    with pytest.raises(OSError):
        atomic_write_text(target, "x" * 2_000_000)
    assert target.read_text() == "old\n" and [p.name for p in small_disk.iterdir()] == ["manifest.json"]


def _rewrite_keeping_stat(path: Path, data: bytes) -> None:
    """Other bytes of the same length, with the old modification time: what a stat cannot see."""
    st = path.stat()
    assert len(data) == st.st_size
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_file_whose_stat_is_the_sealed_one_is_not_read_again(tmp_path):
    ckpts = CheckpointDir(tmp_path, keep=2)
    _save(ckpts, 1, 10)
    model = tmp_path / step_name(1) / "model.pt"
    original = model.read_bytes()
    _rewrite_keeping_stat(model, bytes(len(original)))
    # Resume trusts the stat (reading a terabyte would stall every rank); asked to, it reads.
    assert CheckpointDir(tmp_path, keep=2).verify(1) is None
    assert CheckpointDir(tmp_path, keep=2).verify(1, rehash=True) == "checksum mismatch in model.pt"
    model.touch()  # a new modification time: read again, and found changed
    assert CheckpointDir(tmp_path, keep=2).survey() == (
        None,
        {"step-000001": "checksum mismatch in model.pt"},
    )


def test_an_old_checksums_json_still_verifies_and_is_then_trusted(tmp_path):
    ckpts = CheckpointDir(tmp_path, keep=2)
    _save(ckpts, 1, 10)
    _save(ckpts, 2, 10)
    for step in (1, 2):  # the format before stats: {file: sha256 of the whole file}
        path = tmp_path / step_name(step)
        (path / CHECKSUMS).write_text(json.dumps({"model.pt": file_sha256(path / "model.pt")}))
    _corrupt(tmp_path, 2)
    resumed = CheckpointDir(tmp_path, keep=2)
    assert resumed.survey() == (1, {"step-000002": "checksum mismatch in model.pt"})
    record = json.loads((tmp_path / step_name(1) / CHECKSUMS).read_text())
    model = tmp_path / step_name(1) / "model.pt"
    assert record["files"]["model.pt"] == {"stat": stat_of(model), "sha256": [file_sha256(model)]}


def test_pieces_are_cut_to_size_and_claimed_once_each_by_whichever_rank_is_free():
    """Two ranks (threads) claim from one store, one ten times slower a piece: every piece is hashed
    once, and the fast rank takes more, so neither waits long for the other."""
    sizes = {"a": 0, "b": 5 * 100 + 7, "c": 100, "d": 3 * 100}
    pieces = pieces_of(sizes, chunk_bytes=100)
    assert sum(length for _rel, _offset, length in pieces) == sum(sizes.values())
    store = dist.HashStore()
    taken = {0.02: [], 0.002: []}

    def rank(seconds_a_piece: float) -> None:
        for piece in claimed(pieces, "pieces", store):
            taken[seconds_a_piece].append(piece)
            time.sleep(seconds_a_piece)

    threads = [threading.Thread(target=rank, args=(s,)) for s in taken]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(taken[0.02] + taken[0.002]) == sorted(pieces)  # each piece once
    assert len(taken[0.002]) > len(taken[0.02])
