"""Stage 1 SFT through the real CLI on real ranks: parallel layouts give the losses of one rank,
ZeRO stages agree, a stage that failed after a checkpoint resumes from it to the uninterrupted run's
losses and weights, and a model whose output layer is tied to its embedding trains and exports tied."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from runtime.rank_failure import FAIL_AT_ENV
from stages.data.tokenizer import build_char_tokenizer
from stages.inputs import TINY_VOCAB_SIZE
from stages.models.hf_files import read_hf_weights, save_hf_dir
from stages.models.tiny import build_tiny_llama
from tests.conftest import SMALL_RUN, hpcr1_run, resumed_steps, run_once
from tests.conftest import sft_losses as losses

pytestmark = pytest.mark.dist
STEPS = SMALL_RUN["stage1_sft"]["steps"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run directories made on demand and shared by the tests of this module."""
    return run_once(tmp_path_factory.mktemp("sft"))


def assert_first_steps_close(reference: list[float], other: list[float], tolerance: float, relative=False):
    """Both runs logged every step, and their first 10 losses agree within `tolerance` (absolute, or
    relative to the reference); a run cut short fails here instead of being compared on fewer steps."""
    assert len(reference) == len(other) == STEPS, (len(reference), len(other))
    pairs = list(zip(reference[:10], other[:10], strict=True))
    worst = max(abs(a - b) / (a if relative else 1.0) for a, b in pairs)
    assert worst < tolerance, pairs


def test_dp2_losses_match_one_rank(runs):
    assert_first_steps_close(losses(runs("one-rank", "nproc=1")), losses(runs("dp2")), 1e-4)


def test_tp2_losses_match_tp1(runs):
    tp2 = losses(runs("tp2", "stage1_sft.parallel.tp=2"))
    assert_first_steps_close(losses(runs("one-rank", "nproc=1")), tp2, 1e-4)


def test_zero0_and_zero1_losses_match(runs):
    zero0 = losses(runs("dp2-zero0", "stage1_sft.parallel.zero_stage=0"))
    assert_first_steps_close(losses(runs("dp2")), zero0, 1e-4)


def test_overlap_comm_reduces_in_backward_to_the_same_losses(runs):
    """DeepSpeed's overlap_comm moves ZeRO-1's reduction into backward's hooks (on CPU still
    blocking: no streams); the sums are the same, so are the losses."""
    overlapped = losses(runs("dp2-overlap", "stage1_sft.parallel.overlap_comm=true"))
    assert_first_steps_close(losses(runs("dp2")), overlapped, 1e-5)


def test_losses_fall_and_stage_is_recorded_done(runs):
    run = runs("dp2")
    trace = losses(run)
    assert len(trace) == STEPS and trace[-1] < 0.6 * trace[0], trace
    manifest = json.loads((run / "manifest.json").read_text())["stages"]["stage1_sft"]
    assert manifest["state"] == "done" and manifest["eval"]["n"] == 16
    assert "config.json" in manifest["checksums"] and "model.safetensors" in manifest["checksums"]


def stage_entry(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())["stages"]["stage1_sft"]


def test_a_stage_failed_after_a_checkpoint_resumes_there_to_the_uninterrupted_run(runs, tmp_path):
    """Rank 1 raises as step 7 begins (runtime.rank_failure's failpoint: a fault at a known step, not
    a kill racing the run), two steps past the checkpoint of step 5. The next `hpcr1 run` resumes
    from step 5, repeats step 6 (logged once), and ends with the uninterrupted run's loss at every
    step and its final weights, bit for bit: weights, optimizer state, learning-rate schedule and
    data order all come back from the checkpoint. Killing the whole job anywhere, a checkpoint's
    writing included, is test_kill_anywhere.py's; what one failed rank does to the others and to
    the manifest, test_rank_failure.py's."""
    uninterrupted = runs("dp2")
    run_dir = tmp_path / "failed"
    first = hpcr1_run(run_dir, env={FAIL_AT_ENV: "rank=1,step=7"}, check=False)
    assert first.returncode == 1 and stage_entry(run_dir)["state"] == "failed", first.stdout[-3000:]
    assert len(losses(run_dir)) == 6, "the failed attempt logged steps 1-6"

    out = hpcr1_run(run_dir).stdout
    assert resumed_steps(run_dir) == [5], out
    entry = stage_entry(run_dir)
    assert (entry["state"], entry["attempts"], entry["error"]) == ("done", 2, None), out
    assert losses(run_dir) == losses(uninterrupted)
    final, reference = (d / "stage1_sft" / "final" for d in (run_dir, uninterrupted))
    for name in sorted(p.name for p in reference.glob("*.safetensors")):
        assert (final / name).read_bytes() == (reference / name).read_bytes(), name


def test_done_stage_is_skipped_on_rerun(runs):
    run = runs("dp2")
    before = (run / "manifest.json").read_text()
    out = hpcr1_run(run)
    assert "skipped" in out.stdout
    assert (
        json.loads((run / "manifest.json").read_text())["stages"]["stage1_sft"]["attempts"]
        == json.loads(before)["stages"]["stage1_sft"]["attempts"]
    )


def test_bf16_with_zero2_tracks_fp32(runs):
    """The big configs' setting (bf16 weights, DeepSpeed's bf16 optimizer with fp32 master weights,
    ZeRO-2): its losses follow fp32's within bf16's rounding, and differ (bf16 really ran)."""
    fp32 = losses(runs("dp2"))
    bf16 = losses(runs("dp2-bf16-zero2", "stage1_sft.dtype=bf16", "stage1_sft.parallel.zero_stage=2"))
    assert fp32[:10] != bf16[:10]
    assert_first_steps_close(fp32, bf16, 0.005, relative=True)  # 0.07% seen


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
