"""A real-model-shaped run through all five stages and `hpcr1 eval`: `model.source: hf` with a Llama 3
style tokenizer that has no pad token (byte-level BPE, Llama 3's special tokens and chat template)
and a small random Llama of its vocabulary, on GSM8K-shaped data files (`data.task: files`). The
pipeline pads with the eos and says so, records what max_seq_len cut, and an SFT stage whose
max_seq_len leaves no response token is refused naming the field (stage3_sft here, on synthesised
data)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stages.data.examples import read_examples
from tests.conftest import REPO, hpcr1_env, hpcr1_run
from tests.support.gsm8k_like import gsm8k_like, write_gsm8k_like
from tests.support.llama3 import EOS, build_llama3_model_dir

pytestmark = [pytest.mark.dist, pytest.mark.slow]
STAGES = ["stage1_sft", "stage2_grpo", "stage3_synth", "stage3_sft", "stage4_grpo"]
SFT = {"global_batch_size": 16, "micro_batch_size": 8, "max_seq_len": 160, "warmup_steps": 2}
GRPO = {
    "steps": 2,
    "prompts_per_step": 4,
    "group_size": 4,
    "max_new_tokens": 48,
    "lr": 1e-6,
    "mini_batches": 1,
    "data_parallel": "ddp",
    "old_log_probs": "rollout",
}
# Stage 1 learns the 32 problems nearly by heart (its loss ends under 0.05), so that stage 3's
# rejection sampling keeps answers for stage3_sft to train on; GRPO steps are few and gentle.
CONFIG = {
    "name": "llama3",
    "seed": 0,
    "nproc": 2,
    "model": {"source": "hf", "path": "llama3"},
    "data": {
        "task": "files",
        "sft_file": "sft.jsonl",
        "prompts_file": "prompts.jsonl",
        "eval_file": "eval.jsonl",
    },
    "eval": {"num_examples": 8, "max_new_tokens": 48, "batch_size": 8},
    "wandb": {"mode": "disabled"},
    "stage1_sft": {**SFT, "steps": 160, "lr": 3e-3, "min_lr": 3e-4, "checkpoint_every": 160},
    "stage2_grpo": {**GRPO, "init_from": "stage1_sft"},
    "stage3_synth": {"num_prompts": 16, "samples_per_prompt": 4, "temperature": 0.5, "max_new_tokens": 48},
    "stage3_sft": {**SFT, "init_from": "stage1_sft", "data": "stage3_synth", "steps": 2, "lr": 1e-4},
    "stage4_grpo": {**GRPO, "init_from": "stage3_sft"},
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The GSM8K-shaped files, the Llama 3 style model directory, and the five stages run."""
    root = tmp_path_factory.mktemp("llama3")
    rows = gsm8k_like(32)
    for name, part in (("sft", rows), ("prompts", rows[:16]), ("eval", rows[:8])):
        write_gsm8k_like(root / f"{name}.jsonl", part)
    examples = read_examples(root / "sft.jsonl")
    build_llama3_model_dir(root / "llama3", [f"{ex.prompt}\n{ex.response}" for ex in examples])
    hpcr1_run(root / "run", config=CONFIG)
    return root / "run"


def manifest(run_dir) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())["stages"]


def test_every_stage_is_done_and_held_out_eval_ran(run):
    stages = manifest(run)
    assert [sid for sid in STAGES if stages[sid]["state"] == "done"] == STAGES
    assert stages["stage3_synth"]["eval"]["kept"] > 0
    for sid in STAGES:
        assert stages[sid]["eval"]["n"] == (64 if sid == "stage3_synth" else 8), sid
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "eval", str(run / "stage4_grpo" / "final")]
        + ["--data", str(run.parent / "eval.jsonl")],
        cwd=REPO,
        env=hpcr1_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1])["n"] == 8


def test_each_stage_says_it_pads_with_the_eos(run):
    from transformers import AutoTokenizer

    eos_id = AutoTokenizer.from_pretrained(run / "inputs" / "model").convert_tokens_to_ids(EOS)
    for sid in STAGES:
        log = (run / sid / "logs" / "rank-00000.log").read_text()
        assert f"tokenizer has no pad token: padding with {EOS} (id {eos_id})" in log, sid


def test_sft_stages_record_what_max_seq_len_cut(run):
    stages = manifest(run)
    for sid in ("stage1_sft", "stage3_sft"):
        data = stages[sid]["training_data"]
        assert data["max_seq_len"] == 160 and data["truncated"] == data["left_out"] == 0, data
        assert 0 < data["longest_prompt"] < data["longest"] <= 160
    assert stages["stage1_sft"]["training_data"]["examples"] == 32
    assert stages["stage3_sft"]["training_data"]["examples"] == stages["stage3_synth"]["eval"]["kept"]
    assert (
        "examples, 0 longer than stage1_sft.max_seq_len=160 truncated"
        in (run / "stage1_sft" / "logs" / "rank-00000.log").read_text()
    )


def test_a_max_seq_len_that_leaves_no_response_is_refused_naming_it(run):
    """Runs last (it fails stage3_sft): the synthesised data, prompts of tens of tokens, cut to 8."""
    out = hpcr1_run(run, "stage3_sft.max_seq_len=8", config=CONFIG, check=False)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("hpcr1: error: stage3_sft.max_seq_len: 8 leaves no response token in any of"), line
    assert line.endswith("raise stage3_sft.max_seq_len") and "Traceback" not in out.stdout + out.stderr
    entry = manifest(run)["stage3_sft"]
    assert entry["state"] == "failed" and "stage3_sft.max_seq_len" in entry["error"]["summary"]
    assert entry["training_data"]["left_out"] == entry["training_data"]["examples"]
    assert not (run / "stage3_sft" / "ckpt").exists()
