"""stage2_grpo through launch.worker on 2 real ranks: per-phase times and the GRPO statistics in
metrics.jsonl, a Hugging Face final/ and eval.json, and a resumed run that repeats a lost step
exactly (prompt order and sampling seeds come from (seed, step, rank), weights and optimizer state
from the checkpoint; the prompt selection is kept, not sampled again), with the models sharded
(FSDP2) or whole on each rank (DDP)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess

import pytest

from core.config import load_config
from core.rundir import RunDir
from launch.local import torchrun_command
from pipeline.driver import prepare_run
from tests.conftest import REPO

pytestmark = pytest.mark.dist
PHASES = (
    "weight_sync",
    "rollout",
    "reward",
    "policy_logprob",
    "reference_logprob",
    "advantage",
    "policy_update",
)
ROWS, MAX_NEW_TOKENS = (
    4 * 2,
    24,
)  # prepared_grpo_run: a step's prompts x group size over both ranks; the budget


def run_stage(run: RunDir, stage_id: str) -> None:
    """The stage's 2 ranks as `hpcr1 run` starts them."""
    cmd = torchrun_command(run.root, stage_id, nproc=2)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    logs = "".join(p.read_text()[-3000:] for p in sorted(run.logs(stage_id).glob("rank-*.log")))
    assert proc.returncode == 0, logs


def metrics(run: RunDir) -> list[dict]:
    return [json.loads(line) for line in run.metrics("stage2_grpo").read_text().splitlines()]


def assert_statistics_follow_from_grpo(step: dict, vocab_size: int) -> None:
    """A step's statistics against what GRPO and the reward's rule make them here, not against the
    stage's own arithmetic: the base model never writes the <think>/<answer> tags, so no response
    earns a reward; every group's rewards are then equal, every advantage zero, and the policy
    gradient (and what it would clip) exactly zero."""
    assert (step["reward/mean"], step["reward/std"], step["accuracy"], step["format_rate"]) == (0, 0, 0, 0), (
        step
    )
    assert step["actor/pg_loss"] == 0 and step["actor/clip_frac"] == 0, step
    assert step["actor/kl"] >= 0, step  # low_var_kl is never negative
    tokens = step["response_length/mean"] * ROWS  # a mean over all the step's rows: a whole number of tokens
    assert tokens == round(tokens) and ROWS <= tokens <= ROWS * MAX_NEW_TOKENS, step
    assert 0 < step["entropy"] <= math.log(vocab_size), step  # a mean over tokens, at most uniform's
    phases = sum(step[f"phase_time/{p}"] for p in PHASES)  # phases of this step only, one after another
    assert 0 < phases <= step["step_time_s"], step


def prepared_grpo_run(
    tmp_path, steps: int, data_parallel: str = "fsdp2", max_pass_rate: float = 1.0
) -> RunDir:
    """A run directory with the base model and data of a small stage2_grpo (profile on), not yet run."""
    config = tmp_path / "cfg.yaml"
    config.write_text(
        "name: grpo\nseed: 2\nwandb: {mode: disabled}\nprofile: {comm: true}\n"
        "data: {arithmetic: {sft_size: 16, prompts_size: 16, eval_size: 4}}\n"
        "eval: {num_examples: 4, max_new_tokens: 16, batch_size: 4}\n"
        f"stage2_grpo: {{init_from: base, steps: {steps}, prompts_per_step: 4, group_size: 2, "
        f"max_new_tokens: 24, mini_batches: 2, checkpoint_every: 2, data_parallel: {data_parallel}, "
        f"max_pass_rate: {max_pass_rate}}}\n"
    )
    run = RunDir(tmp_path / "run")
    prepare_run(load_config(config), run, tmp_path)
    return run


@pytest.mark.parametrize("data_parallel", ["fsdp2", "ddp"])
def test_grpo_stage_logs_phases_exports_and_resumes_a_lost_step_exactly(tmp_path, data_parallel):
    # max_pass_rate below 1: the prompts are selected (the base model solves none: all are kept)
    run = prepared_grpo_run(tmp_path, steps=3, data_parallel=data_parallel, max_pass_rate=0.99)
    run_stage(run, "stage2_grpo")
    assert run.prompt_selection("stage2_grpo").is_file()
    first = metrics(run)
    assert [m["step"] for m in first] == [1, 2, 3]
    vocab_size = json.loads((run.base_model / "config.json").read_text())["vocab_size"]
    for step in first:
        assert_statistics_follow_from_grpo(step, vocab_size)
    assert (run.final("stage2_grpo") / "model.safetensors").is_file()
    assert json.loads(run.eval_result("stage2_grpo").read_text())["n"] == 4

    # Lose step 3 (its checkpoint and the outputs) and start again: it resumes from step 2.
    shutil.rmtree(run.ckpt("stage2_grpo") / "step-000003")
    shutil.rmtree(run.final("stage2_grpo"))
    run_stage(run, "stage2_grpo")
    log = (run.logs("stage2_grpo") / "rank-00000.log").read_text()
    assert "resumed from step 2" in log
    # the selection was sampled by the first attempt only: the second read it back
    assert log.count("pass counts kept from an earlier attempt") == 1
    assert log.count("training on the 16 of 16 prompts") == 2
    again = metrics(run)
    assert [m["step"] for m in again] == [1, 2, 3]
    for key in ("response_length/mean", "entropy", "reward/mean", "actor/pg_loss"):
        assert again[2][key] == pytest.approx(first[2][key], abs=1e-6), key
