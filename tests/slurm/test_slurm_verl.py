"""verl's own trainer and generation, submitted to the local Slurm as a user submits them: the verl
template starts Ray apart on the allocation (fake GPUs: the `local` profile's verl_platform 'cpu'),
and the stage driver runs verl's v1 GRPO trainer (`main_ppo`, 2 gloo ranks, FSDP2, the HF rollout)
and generation on verl's rollout replicas. No part of verl is replaced: what the project adds is
the CPU platform (stages/engines/verl_cpu.py), as a GPU cluster adds CUDA.

Faults, on the GRPO stage: USR1 (the job's time limit) requeues it and it resumes from verl's
checkpoint; SIGKILL of the whole job, then `hpcr1 resume`, finishes it from verl's checkpoint; a
Ray worker killed mid-step fails the stage naming it, in bounded time. A verl stage is done only
once its results are ours: the manifest holds final/'s checksums and the held-out result verl logged,
metrics.jsonl verl's step timers under our phase names, and a resubmission would skip it."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
import verl  # noqa: F401  (pinned: a broken install fails here instead of skipping the module)
import yaml
from safetensors.torch import load_file

from core.config import _apply_override, load_resolved
from core.manifest import Manifest
from core.rundir import RunDir
from pipeline.driver import rerun_reason
from stages.engines.verl_io import verl_metric_rows
from tests.conftest import REPO, markdown_table, seconds
from tests.slurm.test_slurm_pipeline import SHRUNK_OVERRIDES, hpcr1, job_story, manifest, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

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
    # an accuracy over the 8 held-out examples: a whole number of them
    assert evaluation["n"] == 8 and float(evaluation["accuracy"] * 8).is_integer(), evaluation


def assert_verl_results_are_ours(run: Path, sid: str) -> None:
    """What the stage driver made of verl's outputs, against verl's own file-logger rows: the
    manifest's held-out result is verl's last validation, final/'s checksums are recorded (and still
    match: a resubmission would skip the stage), metrics.jsonl has every step once with verl's
    timers under our phase names."""
    rows = verl_metric_rows(run / sid / "verl_metrics")
    last_val = [row["data"] for row in rows if "val-core/hpcr1/acc/mean@1" in row["data"]][-1]
    entry = manifest(run)[sid]
    assert entry["eval"]["accuracy"] == last_val["val-core/hpcr1/acc/mean@1"], (entry["eval"], last_val)
    assert any(name.endswith(".safetensors") for name in entry["checksums"]), entry["checksums"]
    ours = [json.loads(line) for line in (run / sid / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in ours] == [row["step"] for row in rows] == list(range(1, len(rows) + 1))
    for mine, theirs in zip(ours, rows):
        assert mine["phase_time/rollout"] == theirs["data"]["timing_s/gen"] > 0
        assert mine["phase_time/policy_update"] == theirs["data"]["timing_s/update_actor"] > 0
    rundir = RunDir(run)
    assert rerun_reason(load_resolved(rundir), rundir, Manifest(run), sid) is None


def assert_the_update_reached_final(init: Path, final: Path) -> None:
    """verl's GRPO changed the policy, and final/ holds the change: some weight differs from the
    init's beyond the bf16 rounding verl's merger applies. (That it learned is not shown: two steps
    on 4 prompts move rewards by noise.)"""
    before, after = load_file(init / "model.safetensors"), load_file(final / "model.safetensors")
    layers = [k for k in before.keys() & after.keys() if ".layers." in k]
    assert layers, (sorted(before), sorted(after))
    moved = [k for k in layers if not before[k].to(torch.bfloat16).float().equal(after[k].float())]
    assert moved, "final/ holds the init's weights: verl's update did not reach it"


def assert_report_times_verl_phases(run: Path, sid: str) -> None:
    """`hpcr1 report`'s phase table for the stage: rollout and policy_update with the wall time verl
    timed over the stage's steps (to the table's printed digits), and communication recorded."""
    report = (run / "report" / "report.md").read_text().split(f"### {sid}\n", 1)[1]
    rows = markdown_table(report, "Time by phase (rank 0): compute and exposed communication")
    wall = {row[0]: seconds(row[1]) for row in rows[1:]}
    verl_rows = verl_metric_rows(run / sid / "verl_metrics")
    for theirs, ours in (("gen", "rollout"), ("update_actor", "policy_update")):
        timed = sum(row["data"][f"timing_s/{theirs}"] for row in verl_rows)
        assert wall[ours] == pytest.approx(timed, rel=1e-3), (ours, wall, timed)
    header, *ops = markdown_table(report, "Communication by operation (per rank)")
    assert ops and all(int(row[header.index("calls")]) > 0 for row in ops), ops


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
    # The kill comes after the requeued attempt's own first checkpoint (not one the first attempt
    # may have written before the USR1 reached it).
    requeued_from = int(wait_for(lambda: resumed_from(run, sid)[:1], "the requeued attempt to resume",
                                 timeout=600, explain=lambda: job_story(slurm_env, run, sid))[0])  # fmt: skip
    wait_for(checkpoint(run, sid, requeued_from + 1).exists, "the requeued attempt's first checkpoint",
             timeout=600, explain=lambda: job_story(slurm_env, run, sid))  # fmt: skip
    job = manifest(run)[sid]["job_id"]
    subprocess.run(["scancel", "--full", "--signal=KILL", job], env=slurm_env, check=True)
    wait_for(lambda: job not in queued_jobs(slurm_env), "the killed job to leave the queue")
    killed_at = int((run / sid / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    assert killed_at < 6 and not (run / sid / "final").exists()

    hpcr1(slurm_env, "resume", str(run), "--cluster", "local")
    entry = wait_state(slurm_env, run, sid)
    assert_done_on_verl(slurm_env, run, sid)
    assert_verl_results_are_ours(run, sid)
    assert entry["attempts"] == 3 and entry["preempted"] == 1
    # Each attempt kept its own metrics; together they hold every step once.
    assert len(list((run / sid / "verl_metrics").glob("attempt-*.jsonl"))) == 3
    steps = [json.loads(line)["step"] for line in (run / sid / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    # The requeued and the resumed attempt began at verl's checkpoints, not at step 1.
    assert resumed_from(run, sid) == [requeued_from, killed_at] and requeued_from >= 1, resumed_from(run, sid)


def resumed_from(run: Path, sid: str) -> list[int]:
    """The steps verl's attempts resumed from, in order (its trainer logs each)."""
    log = run / sid / "logs" / "rank-00000.log"
    text = log.read_text() if log.exists() else ""
    return [int(step) for step in re.findall(r"Resuming from \S+/global_step_(\d+),", text)]


CHAIN = ["stage1_sft", "stage2_grpo", "stage3_synth", "stage3_sft", "stage4_grpo"]


@pytest.mark.verl_chain
@pytest.mark.timeout(VERL_CHAIN_TIMEOUT_S)
def test_the_five_stages_with_every_verl_engine_finish_as_chained_jobs(slurm_env, tmp_path):
    """GRPO twice on verl's trainer, synthesis and every stage's held-out eval on verl's replicas;
    verl's outputs handed over in our formats (final/ a Llama holding the update, metrics, report)."""
    run = submit(slurm_env, tmp_path, verl_config(stages=CHAIN))
    for sid in CHAIN:
        wait_state(slurm_env, run, sid, timeout=1200)
        if sid != "stage3_synth":
            assert_done_on_verl(slurm_env, run, sid)
    for sid, init in (("stage2_grpo", "stage1_sft"), ("stage4_grpo", "stage3_sft")):
        assert_verl_results_are_ours(run, sid)
        assert_the_update_reached_final(run / init / "final", run / sid / "final")
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(run / "stage2_grpo" / "final").config.model_type == "llama"
    assert list((run / "stage2_grpo" / "profile").glob("rank-*.jsonl"))
    synth = run / "stage3_synth"
    assert manifest(run)["stage3_synth"]["state"] == "done", job_story(slurm_env, run, "stage3_synth")
    assert json.loads((synth / "final" / "provenance.json").read_text())["engine"] == "verl"
    rows = [json.loads(line) for line in next(synth.rglob("synthetic.jsonl")).read_text().splitlines()]
    assert rows and all(row["reward"] > 0 and row["model"] for row in rows)
    hpcr1(slurm_env, "report", str(run))
    for sid in ("stage2_grpo", "stage4_grpo"):
        assert_report_times_verl_phases(run, sid)
