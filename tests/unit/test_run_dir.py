"""The run directory's pieces: atomic manifest, checkpoint sealing and verification, the
resumable global batch order and the loss-token count."""

from __future__ import annotations

import json

import pytest

from core.config import load_config
from core.manifest import Manifest
from stages.checkpoint import CheckpointDir
from stages.data.sft_batches import GlobalBatchOrder, Sample, count_loss_tokens, micro_batches
from tests.conftest import REPO


def test_manifest_survives_reload_and_leaves_no_temp_files(tmp_path):
    m = Manifest(tmp_path)
    m.start_attempt("stage1_sft")
    m.finish("stage1_sft", eval={"accuracy": 0.5, "n": 10})
    again = Manifest(tmp_path).stage("stage1_sft")
    assert again["state"] == "done" and again["attempts"] == 1 and again["eval"]["accuracy"] == 0.5
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_manifest_rejects_unknown_state(tmp_path):
    with pytest.raises(ValueError):
        Manifest(tmp_path).update("stage1_sft", state="finished")


def _write_ckpt(ckpts: CheckpointDir, step: int, payload: bytes) -> None:
    staging = ckpts.staging(step)
    staging.mkdir(parents=True)
    (staging / "model.pt").write_bytes(payload)
    ckpts.seal(step)


def test_corrupted_newest_checkpoint_falls_back_to_previous(tmp_path):
    ckpts = CheckpointDir(tmp_path, keep=3)
    _write_ckpt(ckpts, 5, b"five")
    _write_ckpt(ckpts, 10, b"ten")
    assert ckpts.newest_valid() == 10
    (tmp_path / "step-000010" / "model.pt").write_bytes(b"te")  # truncated
    assert ckpts.newest_valid() == 5


def test_unsealed_checkpoint_is_never_used_and_retention_keeps_newest(tmp_path):
    ckpts = CheckpointDir(tmp_path, keep=2)
    for step in (1, 2, 3):
        _write_ckpt(ckpts, step, str(step).encode())
    ckpts.staging(4).mkdir()  # a write that died before sealing
    assert ckpts.sealed_steps() == [2, 3] and ckpts.newest_valid() == 3


def test_batch_order_covers_every_sample_once_per_epoch_and_is_reproducible():
    order = GlobalBatchOrder(num_samples=12, global_batch_size=4, seed=7)
    epoch = sum((order.indices(step) for step in range(3)), [])
    assert sorted(epoch) == list(range(12))
    assert GlobalBatchOrder(12, 4, 7).indices(4) == order.indices(4)  # rebuilt from the step alone
    assert order.indices(3) != order.indices(0)


def test_micro_batches_shift_labels_and_mask_padding():
    samples = [Sample([1, 2, 3, 4], [0, 0, 1, 1]), Sample([5, 6], [0, 1])]
    (mb,) = micro_batches(samples, pad_id=0, micro_batch_size=2)
    assert mb.input_ids.tolist() == [[1, 2, 3], [5, 6, 0]]
    assert mb.labels.tolist() == [[2, 3, 4], [6, 0, 0]]
    assert mb.loss_mask.tolist() == [[0, 1, 1], [1, 0, 0]]
    assert count_loss_tokens(samples) == mb.loss_mask.sum().item() == 3


def test_overrides_reach_nested_fields_and_config_round_trips(tmp_path):
    cfg = load_config(
        REPO / "configs" / "tiny-cpu.yaml", ["stage1_sft.parallel.tp=2", "seed=5", "wandb.mode=disabled"]
    )
    assert cfg.stage1_sft.parallel.tp == 2 and cfg.seed == 5 and cfg.wandb.mode == "disabled"
    assert json.loads(cfg.model_dump_json())["stage1_sft"]["parallel"]["tp"] == 2


def test_micro_batches_group_similar_lengths_and_pad_each_only_to_its_longest():
    lengths = [9, 3, 8, 2, 7, 4]
    samples = [Sample(list(range(1, n + 1)), [0] + [1] * (n - 1)) for n in lengths]
    batches = micro_batches(samples, pad_id=0, micro_batch_size=2)
    assert [tuple(mb.input_ids.shape) for mb in batches] == [(2, 8), (2, 6), (2, 2)]
    assert sorted(len(row) for mb in batches for row in mb.loss_mask.tolist()) == [2, 2, 6, 6, 8, 8]
    assert sum(mb.loss_mask.sum().item() for mb in batches) == count_loss_tokens(samples)
