"""verl's own trainer and generation, submitted to the local Slurm as a user submits them: the verl
template starts Ray apart on the allocation (fake GPUs: the `local` profile's verl_platform 'cpu'),
and the stage driver runs verl's v1 GRPO trainer (`main_ppo`, 2 gloo ranks, FSDP2, the HF rollout)
and generation on verl's rollout replicas. No part of verl is replaced: what the project adds is
the CPU platform (stages/engines/verl_cpu.py), as a GPU cluster adds CUDA.

Faults, on the GRPO stage: USR1 (the job's time limit) requeues it and it resumes from verl's
checkpoint; SIGKILL of the whole job, then `hpcr1 resume`, finishes it from verl's checkpoint; a
Ray worker killed mid-step fails the stage naming it, in bounded time."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from core.config import _apply_override
from tests.conftest import REPO
from tests.slurm.test_slurm_pipeline import SHRUNK_OVERRIDES, hpcr1, job_story, manifest, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
import verl  # noqa: E402, F401  (pinned: a broken install must fail, not skip)

# A chain of verl jobs, each waited for up to 900-1200 s: more than the 900 s pytest gives a test.
VERL_CHAIN_TIMEOUT_S = 2400

# verl on the local profile's 2 ranks: one rollout replica a rank, micro-batches a rank can hold.
VERL = [
    *(f"{sid}.engine=verl" for sid in ("stage2_grpo", "stage4_grpo", "stage3_synth")),
    *(f"{section}.verl.rollout_tp=1" for section in ("stage2_grpo", "stage4_grpo", "stage3_synth", "eval")),
    *(f"{sid}.verl.micro_batch_size_per_gpu=2" for sid in ("stage2_grpo", "stage4_grpo")),
    *(f"{sid}.verl.max_prompt_length=64" for sid in ("stage2_grpo", "stage4_grpo", "stage3_synth")),
    "eval.verl.max_prompt_length=64",
    "eval.engine=verl",
]


def verl_config(*extra: str, stages=("stage1_sft", "stage2_grpo")) -> dict:
    """The shrunk embedded default with every verl engine on, cut to `stages`."""
    config = yaml.safe_load((REPO / "configs" / "tiny-cpu.yaml").read_text())
    for item in [*SHRUNK_OVERRIDES, *VERL, *extra]:
        _apply_override(config, item)
    for sid in ("stage1_sft", "stage2_grpo", "stage3_synth", "stage3_sft", "stage4_grpo"):
        if sid not in stages:
            config.pop(sid, None)
    return config


@pytest.fixture(autouse=True)
def cancel_at_the_end(slurm_env, tmp_path):
    """A test that fails leaves no job behind: its Ray would hold the profile's ports for the next."""
    yield
    if (tmp_path / "run" / "manifest.json").exists():
        hpcr1(slurm_env, "cancel", str(tmp_path / "run"), check=False)


def submit(env, tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    hpcr1(env, "submit", str(path), "--cluster", "local", "--run-dir", str(run))
    return run


def checkpoint(run: Path, sid: str, step: int) -> Path:
    return run / sid / "ckpt" / f"global_step_{step}"


def wait_state(env, run: Path, sid: str, states=("done", "failed"), timeout: float = 900) -> dict:
    wait_for(
        lambda: manifest(run)[sid]["state"] in states,
        f"{sid} to end",
        timeout=timeout,
        explain=lambda: job_story(env, run, sid),
    )
    return manifest(run)[sid]


def queued_jobs(env) -> list[str]:
    return subprocess.run(
        ["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True
    ).stdout.split()


def assert_done_on_verl(env, run: Path, sid: str) -> None:
    entry = manifest(run)[sid]
    assert entry["state"] == "done", job_story(env, run, sid)
    evaluation = json.loads((run / sid / "eval.json").read_text())
    assert 0 <= evaluation["accuracy"] <= 1 and evaluation["n"] == 8


def test_a_verl_grpo_stage_runs_as_a_slurm_job_and_hands_over_in_our_formats(slurm_env, tmp_path):
    sid = "stage2_grpo"
    run = submit(slurm_env, tmp_path, verl_config(f"{sid}.init_from=base", f"{sid}.steps=3", stages=(sid,)))
    wait_state(slurm_env, run, sid)
    assert_done_on_verl(slurm_env, run, sid)
    steps = [json.loads(line)["step"] for line in (run / sid / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(run / sid / "final").config.model_type == "llama"
    # verl's step timers as our phases, and its torch-profiler traces as communication events
    hpcr1(slurm_env, "report", str(run))
    report = (run / "report" / "report.md").read_text()
    assert "rollout" in report and "policy_update" in report
    assert list((run / sid / "profile").glob("rank-*.jsonl"))


@pytest.mark.verl_chain
@pytest.mark.timeout(VERL_CHAIN_TIMEOUT_S)
def test_verl_grpo_survives_usr1_and_sigkill_and_eval_runs_on_verls_replicas(slurm_env, tmp_path):
    # 6 GRPO steps, a checkpoint each: USR1 lands after the first, SIGKILL after the second.
    run = submit(slurm_env, tmp_path, verl_config("stage1_sft.steps=10", "stage2_grpo.steps=6"))
    wait_state(slurm_env, run, "stage1_sft", ("done",))
    assert_done_on_verl(slurm_env, run, "stage1_sft")
    assert json.loads((run / "stage1_sft" / "eval.json").read_text())["engine"] == "verl"

    sid = "stage2_grpo"
    wait_for(checkpoint(run, sid, 1).exists, "verl's step-1 checkpoint", timeout=600,
             explain=lambda: job_story(slurm_env, run, sid))  # fmt: skip
    subprocess.run(
        ["scancel", "--batch", "--signal=USR1", manifest(run)[sid]["job_id"]], env=slurm_env, check=True
    )
    wait_for(lambda: manifest(run)[sid].get("preempted") == 1, "the requeue", timeout=120,
             explain=lambda: job_story(slurm_env, run, sid))  # fmt: skip

    wait_for(checkpoint(run, sid, 2).exists, "verl's step-2 checkpoint, after the requeue", timeout=600,
             explain=lambda: job_story(slurm_env, run, sid))  # fmt: skip
    job = manifest(run)[sid]["job_id"]
    subprocess.run(["scancel", "--full", "--signal=KILL", job], env=slurm_env, check=True)
    wait_for(lambda: job not in queued_jobs(slurm_env), "the killed job to leave the queue")
    killed_at = int((run / sid / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    assert killed_at < 6 and not (run / sid / "final").exists()

    hpcr1(slurm_env, "resume", str(run), "--cluster", "local")
    entry = wait_state(slurm_env, run, sid)
    assert_done_on_verl(slurm_env, run, sid)
    assert entry["attempts"] == 3 and entry["preempted"] == 1
    # Each attempt kept its own metrics; together they hold every step once.
    assert len(list((run / sid / "verl_metrics").glob("attempt-*.jsonl"))) == 3
    steps = [json.loads(line)["step"] for line in (run / sid / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    # The requeued and the resumed attempt began at verl's checkpoints, not at step 1.
    log = (run / sid / "logs" / "rank-00000.log").read_text()
    resumed = re.findall(r"Resuming from \S+/global_step_(\d+),", log)
    assert resumed == ["1", str(killed_at)], resumed


CHAIN = ["stage1_sft", "stage2_grpo", "stage3_synth", "stage3_sft", "stage4_grpo"]


@pytest.mark.verl_chain
@pytest.mark.timeout(VERL_CHAIN_TIMEOUT_S)
def test_the_five_stages_with_every_verl_engine_finish_as_chained_jobs(slurm_env, tmp_path):
    """GRPO twice on verl's trainer, synthesis and every stage's held-out eval on verl's replicas."""
    run = submit(slurm_env, tmp_path, verl_config(stages=CHAIN))
    for sid in CHAIN:
        wait_state(slurm_env, run, sid, timeout=1200)
        if sid != "stage3_synth":
            assert_done_on_verl(slurm_env, run, sid)
    synth = run / "stage3_synth"
    assert manifest(run)["stage3_synth"]["state"] == "done", job_story(slurm_env, run, "stage3_synth")
    assert json.loads((synth / "final" / "provenance.json").read_text())["engine"] == "verl"
    rows = [json.loads(line) for line in next(synth.rglob("synthetic.jsonl")).read_text().splitlines()]
    assert rows and all(row["reward"] > 0 and row["model"] for row in rows)
    hpcr1(slurm_env, "report", str(run))
    report = (run / "report" / "report.md").read_text()
    assert "stage2_grpo" in report and "rollout" in report
