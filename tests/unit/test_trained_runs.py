"""The shared trained runs' key and guard (tests/support/trained_runs.py), without training: the key
follows what makes a run (a config field, the stages, the device's environment) and nothing else,
and a write into a shared run is caught even where chmod does not stop it (root)."""

from __future__ import annotations

import copy
import os

import pytest

from tests.conftest import SMALL_RUN, snapshot
from tests.support.trained_runs import TrainedRun, key_inputs, key_of


def key(tmp_path, *overrides, config=SMALL_RUN, stages=("stage1_sft",), env=None) -> str:
    return key_of(key_inputs(config, overrides, stages, env, tmp_path / "scratch"))


def test_the_key_follows_the_resolved_config_stages_and_environment(tmp_path):
    base = key(tmp_path)
    spelled_out = copy.deepcopy(SMALL_RUN)
    spelled_out["stage1_sft"]["steps"] = 4
    assert key(tmp_path, "stage1_sft.steps=4") == key(tmp_path, config=spelled_out) != base
    assert key(tmp_path, "model.tiny.hidden_size=32") != base
    assert key(tmp_path, f"seed={SMALL_RUN['seed']}") == base  # the default spelled out is the same run
    assert key(tmp_path, stages=("stage1_sft", "stage2_grpo")) != base
    assert key(tmp_path, env={"HPCR1_FAKEGPU": "1"}) != base
    assert key(tmp_path, env={"PATH": os.environ["PATH"]}) == base  # what every run gets anyway


def test_overrides_are_fields_only(tmp_path):
    with pytest.raises(AssertionError, match="KEY=VALUE"):
        key(tmp_path, "--only", "stage1_sft")


def shared(tmp_path) -> TrainedRun:
    run = tmp_path / "shared" / "run"
    (run / "stage1_sft" / "final").mkdir(parents=True)
    (run / "stage1_sft" / "final" / "model.safetensors").write_bytes(b"weights")
    return TrainedRun(run, SMALL_RUN, (), ("stage1_sft",), None, snapshot(run))


def test_a_write_into_a_shared_run_is_caught(tmp_path):
    trained = shared(tmp_path)
    trained.check_unchanged()
    (trained.path / "stage1_sft" / "final" / "model.safetensors").write_bytes(b"changed")
    with pytest.raises(AssertionError, match="stage1_sft/final/model.safetensors"):
        trained.check_unchanged()


def test_a_copy_is_writable_and_leaves_the_shared_run_as_it_was(tmp_path):
    trained = shared(tmp_path)
    os.chmod(trained.path / "stage1_sft" / "final" / "model.safetensors", 0o444)
    copied = trained.copy_to(tmp_path / "mine")
    assert snapshot(copied) == trained.checksums
    assert (copied / "stage1_sft" / "final" / "model.safetensors").stat().st_mode & 0o200
    trained.check_unchanged()
