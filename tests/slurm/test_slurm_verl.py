"""verl's own trainer and generation, submitted to the local Slurm as a user submits them: the verl
template starts Ray apart on the allocation (fake GPUs: the `local` profile's verl_platform 'cpu'),
and the stage driver runs verl's v1 GRPO trainer (`main_ppo`, 2 gloo ranks, FSDP2, the HF rollout)
and generation on verl's rollout replicas. No part of verl is replaced: what the project adds is
the CPU platform (stages/engines/verl_cpu.py), as a GPU cluster adds CUDA.

Faults, on the first GRPO stage of the chain: USR1 (the job's time limit) requeues it and it
resumes from verl's checkpoint; SIGKILL of the whole job, then `hpcr1 resume`, finishes it from
verl's checkpoint and runs the stages after it. A Ray worker killed mid-step:
tests/dist/test_verl_on_cpu.py."""

from __future__ import annotations

import json
import os
import re
import signal
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


def wait_state(
    env, run: Path, sid: str, states=("done", "failed"), timeout: float = 900, attempts_above: int = 0
) -> dict:
    """Waits for `sid` to reach one of `states` in an attempt after the first `attempts_above`: after a
    resume the manifest holds the killed attempt's state until the resubmitted job starts."""

    def reached() -> bool:
        entry = manifest(run)[sid]
        return entry["state"] in states and entry.get("attempts", 0) > attempts_above

    wait_for(
        reached,
        f"{sid} to end",
        timeout=timeout,
        explain=lambda: job_story(env, run, sid),
    )
    return manifest(run)[sid]


def queued_jobs(env) -> list[str]:
    return subprocess.run(
        ["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True
    ).stdout.split()


def kill_whole_job(env, job: str) -> None:
    """SIGKILL to every process of the job, as Slurm's cgroup process tracking does on a cluster. The
    local Slurm tracks process groups, which Ray's daemons leave: they would train on for seconds."""
    for pid in Path("/proc").iterdir():
        try:
            if f"SLURM_JOB_ID={job}\0".encode() in (pid / "environ").read_bytes():
                os.kill(int(pid.name), signal.SIGKILL)
        except (OSError, ValueError):  # not a process, or it ended meanwhile
            pass
    subprocess.run(["scancel", "--full", "--signal=KILL", job], env=env, check=True)


def assert_done_on_verl(env, run: Path, sid: str) -> None:
    entry = manifest(run)[sid]
    assert entry["state"] == "done", job_story(env, run, sid)
    evaluation = json.loads((run / sid / "eval.json").read_text())
    assert 0 <= evaluation["accuracy"] <= 1 and evaluation["n"] == 8


CHAIN = ["stage1_sft", "stage2_grpo", "stage3_synth", "stage3_sft", "stage4_grpo"]


@pytest.mark.verl_chain
@pytest.mark.timeout(VERL_CHAIN_TIMEOUT_S)
def test_the_five_stages_on_every_verl_engine_survive_usr1_and_sigkill_as_chained_jobs(slurm_env, tmp_path):
    """GRPO twice on verl's trainer, synthesis and every stage's held-out eval on verl's replicas.
    The first GRPO stage (6 steps, a checkpoint each) is preempted by USR1 after its first checkpoint:
    it requeues and resumes from it. Its whole job is then SIGKILLed after the second, which takes
    the stages queued after it out of the queue too; `hpcr1 resume` finishes it from verl's
    checkpoint and runs the rest. verl's outputs are handed over in our formats."""
    run = submit(slurm_env, tmp_path, verl_config("stage2_grpo.steps=6", stages=CHAIN))
    wait_state(slurm_env, run, "stage1_sft", ("done",), timeout=1200)
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
    kill_whole_job(slurm_env, manifest(run)[sid]["job_id"])
    # Slurm drops the stages that waited on it (kill_invalid_depend): nothing is left queued
    wait_for(lambda: not queued_jobs(slurm_env), "the killed job and the stages after it to leave the queue")
    killed_at = int((run / sid / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    assert 2 <= killed_at < 6 and not (run / sid / "final").exists()

    attempts = {stage: manifest(run)[stage].get("attempts", 0) for stage in CHAIN}
    hpcr1(slurm_env, "resume", str(run), "--cluster", "local")
    for stage in CHAIN[1:]:
        wait_state(slurm_env, run, stage, timeout=1200, attempts_above=attempts[stage])
        if stage != "stage3_synth":
            assert_done_on_verl(slurm_env, run, stage)
    entry = manifest(run)[sid]
    assert entry["attempts"] == 3 and entry["preempted"] == 1
    # Each attempt kept its own metrics; together they hold every step once.
    assert len(list((run / sid / "verl_metrics").glob("attempt-*.jsonl"))) == 3
    steps = [json.loads(line)["step"] for line in (run / sid / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    # The requeued and the resumed attempt began at verl's checkpoints, not at step 1.
    log = (run / sid / "logs" / "rank-00000.log").read_text()
    resumed = re.findall(r"Resuming from \S+/global_step_(\d+),", log)
    assert resumed == ["1", str(killed_at)], resumed
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(run / sid / "final").config.model_type == "llama"

    synth = run / "stage3_synth"
    assert json.loads((synth / "final" / "provenance.json").read_text())["engine"] == "verl"
    rows = [json.loads(line) for line in next(synth.rglob("synthetic.jsonl")).read_text().splitlines()]
    assert rows and all(row["reward"] > 0 and row["model"] for row in rows)
    # verl's step timers as our phases, and its torch-profiler traces as communication events
    hpcr1(slurm_env, "report", str(run))
    report = (run / "report" / "report.md").read_text()
    assert "stage2_grpo" in report and "rollout" in report and "policy_update" in report
    assert list((run / sid / "profile").glob("rank-*.jsonl"))
