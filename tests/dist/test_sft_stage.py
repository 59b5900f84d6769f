"""Stage 1 SFT through the real CLI on real ranks: parallel layouts give the losses of one rank,
ZeRO stages agree, a killed run resumes from its checkpoint to the same result, and a model whose
output layer is tied to its embedding trains and exports tied."""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from stages.data.tokenizer import build_char_tokenizer
from stages.inputs import TINY_VOCAB_SIZE
from stages.models.hf_files import read_hf_weights, save_hf_dir
from stages.models.tiny import build_tiny_llama
from tests.conftest import SMALL_RUN, hpcr1_run, kill_run_at_checkpoint, resumed_steps, run_once
from tests.conftest import sft_losses as losses

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run directories made on demand and shared by the tests of this module."""
    return run_once(tmp_path_factory.mktemp("sft"))


def test_dp2_losses_match_one_rank(runs):
    one = losses(runs("one-rank", "nproc=1"))
    dp2 = losses(runs("dp2"))
    assert max(abs(a - b) for a, b in zip(one[:10], dp2[:10])) < 1e-4, (one[:10], dp2[:10])


def test_tp2_losses_match_tp1(runs):
    one = losses(runs("one-rank", "nproc=1"))
    tp2 = losses(runs("tp2", "stage1_sft.parallel.tp=2"))
    assert max(abs(a - b) for a, b in zip(one[:10], tp2[:10])) < 1e-4, (one[:10], tp2[:10])


def test_zero0_and_zero1_losses_match(runs):
    zero1 = losses(runs("dp2"))
    zero0 = losses(runs("dp2-zero0", "stage1_sft.parallel.zero_stage=0"))
    assert max(abs(a - b) for a, b in zip(zero0[:10], zero1[:10])) < 1e-4


def test_overlap_comm_reduces_in_backward_to_the_same_losses(runs):
    """DeepSpeed's overlap_comm moves ZeRO-1's reduction into backward's hooks (on CPU still
    blocking: no streams); the sums are the same, so are the losses."""
    zero1 = losses(runs("dp2"))
    overlapped = losses(runs("dp2-overlap", "stage1_sft.parallel.overlap_comm=true"))
    assert max(abs(a - b) for a, b in zip(zero1[:10], overlapped[:10])) < 1e-5, (zero1[:10], overlapped[:10])


def test_losses_fall_and_stage_is_recorded_done(runs):
    run = runs("dp2")
    trace = losses(run)
    assert trace[-1] < 0.6 * trace[0], trace
    manifest = json.loads((run / "manifest.json").read_text())["stages"]["stage1_sft"]
    assert manifest["state"] == "done" and manifest["eval"]["n"] == 16
    assert "config.json" in manifest["checksums"] and "model.safetensors" in manifest["checksums"]


def test_killed_run_resumes_from_checkpoint_and_matches_uninterrupted(runs, tmp_path):
    reference = losses(runs("dp2"))
    run_dir = tmp_path / "killed"
    kill_run_at_checkpoint(run_dir, 5)
    killed_at = len(losses(run_dir))
    assert killed_at < 20, "the run finished before it could be killed: nothing was tested"

    out = hpcr1_run(run_dir)
    resumed = resumed_steps(run_dir)
    assert resumed and resumed[0] >= 5, out.stdout
    manifest = json.loads((run_dir / "manifest.json").read_text())["stages"]["stage1_sft"]
    assert manifest["attempts"] == 2 and manifest["state"] == "done", out.stdout
    after = losses(run_dir)
    assert len(after) == 20
    assert abs(after[-1] - reference[-1]) < 1e-4, (after[-5:], reference[-5:])


def test_done_stage_is_skipped_on_rerun(runs):
    run = runs("dp2")
    before = (run / "manifest.json").read_text()
    out = hpcr1_run(run)
    assert "skipped" in out.stdout
    assert json.loads((run / "manifest.json").read_text())["stages"]["stage1_sft"]["attempts"] == \
        json.loads(before)["stages"]["stage1_sft"]["attempts"]


def test_bf16_with_zero2_tracks_fp32(runs):
    """The big configs' setting (bf16 weights, DeepSpeed's bf16 optimizer with fp32 master weights,
    ZeRO-2): its losses follow fp32's within bf16's rounding, and differ (bf16 really ran)."""
    fp32 = losses(runs("dp2"))[:10]
    bf16 = losses(runs("dp2-bf16-zero2", "stage1_sft.dtype=bf16", "stage1_sft.parallel.zero_stage=2"))[:10]
    assert fp32 != bf16
    assert max(abs(a - b) / a for a, b in zip(fp32, bf16)) < 0.005, (fp32, bf16)  # 0.07% seen


@pytest.fixture(scope="module")
def tied_and_untied_twins(tmp_path_factory) -> dict[bool, Path]:
    """The same tiny model as HF directories, {tied: path}: tied (no lm_head.weight, as transformers
    writes it), and untied with lm_head.weight a copy of the embedding."""
    root = tmp_path_factory.mktemp("twins")
    tokenizer = build_char_tokenizer(root / "base")
    ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    build_tiny_llama(root / "base", vocab_size=TINY_VOCAB_SIZE, seed=SMALL_RUN["seed"], **ids)
    untied = read_hf_weights(root / "base")
    untied["lm_head.weight"] = untied["model.embed_tokens.weight"].clone()
    tied = {name: w for name, w in untied.items() if name != "lm_head.weight"}
    twins = {}
    for is_tied, weights in ((True, tied), (False, untied)):
        twins[is_tied] = shutil.copytree(root / "base", root / f"tied-{is_tied}")  # tokenizer's files
        config = AutoConfig.from_pretrained(root / "base")
        config.tie_word_embeddings = is_tied
        save_hf_dir(weights, config, twins[is_tied])
    return twins


def test_tied_model_trains_as_its_untied_twin_at_first_and_exports_tied(runs, tied_and_untied_twins):
    """Step 1's loss is a forward of equal weights; after it the tied embedding has taken the output
    layer's gradient too, so the twins part; final/ is tied as transformers reads it."""
    trace = {
        tied: losses(runs(f"tied-{tied}", "model.source=hf", f"model.path={path}", "stage1_sft.steps=3"))
        for tied, path in tied_and_untied_twins.items()
    }
    assert trace[True][0] == trace[False][0] and trace[True][1] != trace[False][1], trace
    final = runs("tied-True") / "stage1_sft" / "final"
    assert "lm_head.weight" not in read_hf_weights(final)
    model = AutoModelForCausalLM.from_pretrained(final)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
