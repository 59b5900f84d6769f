"""The pipeline on a real (local, single-node) Slurm: cancel + resume, the exit code srun reports for
ranks leaving for a USR1 requeue, and a failed stage ending its dependants — with `hpcr1 status`
saying so. The five stages as chained jobs (hostile names included) and the USR1 requeue itself run
on the multi-node cluster: test_multinode_pipeline, test_multinode_faults."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from core.cluster import load_profile
from launch.sbatch import render_verl_script
from launch.slurm_launch import srun_command
from tests.conftest import REPO, SMALL_RUN

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
TWO_STAGES = {
    **SMALL_RUN,
    "name": "slurm",
    "stage3_sft": {**SMALL_RUN["stage1_sft"], "init_from": "stage1_sft"},
}


def hpcr1(env, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert not check or out.returncode == 0, out.stdout + out.stderr
    return out


def submit(env, tmp_path: Path, config: dict, *extra: str, cluster: str = "local") -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    hpcr1(env, "submit", str(path), "--cluster", cluster, "--run-dir", str(run), *extra)
    return run


def manifest(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())["stages"]


def wait_for(predicate, what: str, timeout: float = 400, explain=lambda: ""):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}\n{explain()}")


def job_story(env, run: Path, stage: str) -> str:
    """What a timed-out wait shows: the stage's manifest entry, Slurm's view of its job, the job's output."""
    entry = manifest(run)[stage]
    job = subprocess.run(
        ["scontrol", "show", "job", entry.get("job_id", "")], env=env, capture_output=True, text=True
    ).stdout
    outputs = sorted((run / stage / "logs").glob("slurm-*.out"))
    tail = outputs[-1].read_text()[-2000:] if outputs else "(no job output)"
    return f"manifest: {json.dumps(entry)}\nscontrol show job:\n{job}\njob output (tail):\n{tail}"


def all_done(run: Path) -> bool:
    stages = manifest(run)
    return len(stages) == 2 and all(e["state"] == "done" for e in stages.values())


def overrides(section: str, **fields) -> list[str]:
    return [f"{section}.{key}={value}" for key, value in fields.items()]


# configs/tiny-cpu.yaml cut to a few steps on one-digit sums, as `hpcr1 submit` overrides: stage 1
# must learn enough (~0.5 accuracy in 150 steps) for the synthesis stage to find correct answers, or
# it fails, as it should. The multi-node pipeline test submits them; the verl chains build on them.
SHRUNK_OVERRIDES = [
    # one of the 100 one-digit sums is in the validation split
    "data.arithmetic={num_operands: 2, digits: 1, sft_size: 64, prompts_size: 8, eval_size: 8, "
    "validation_size: 1}",
    "eval={num_examples: 8, max_new_tokens: 24, batch_size: 8}",
    "wandb.mode=disabled",
    *overrides("stage1_sft", steps=150, global_batch_size=32, micro_batch_size=16, lr=3e-3, min_lr=3e-4),
    *overrides("stage1_sft", warmup_steps=2, checkpoint_every=50),
    *overrides(
        "stage3_sft", steps=4, global_batch_size=8, micro_batch_size=4, warmup_steps=1, checkpoint_every=2
    ),
    *(
        item
        for grpo in ("stage2_grpo", "stage4_grpo")
        for item in overrides(
            grpo, steps=2, prompts_per_step=4, group_size=2, max_new_tokens=24, checkpoint_every=1
        )
    ),
    *overrides("stage3_synth", num_prompts=8, samples_per_prompt=2, max_new_tokens=24, batch_size=8),
]


def test_cancelled_stage_resumes_without_recomputing_done_stages(slurm_env, tmp_path):
    """The cancel comes at a known point: the job is suspended (Slurm stops its processes) once the
    step-10 checkpoint appears, so that it is still unfinished when cancelled, however loaded the
    machine. The 40 steps after that point only have to outlast the wait's 0.5 s poll and the
    suspend (~11 steps a second here at most), and the resumed attempt trains them again."""
    config = {**TWO_STAGES, "stage3_sft": {**TWO_STAGES["stage3_sft"], "steps": 50, "checkpoint_every": 5}}
    run = submit(slurm_env, tmp_path, config)
    ckpts = run / "stage3_sft" / "ckpt"
    # any sealed step from 10 on (the oldest are pruned: keep_checkpoints); 10 minutes, as the
    # stage's ranks start behind stage 1 on a loaded machine
    wait_for(lambda: max(checkpoint_steps(ckpts), default=0) >= 10, "a checkpoint from step 10", timeout=600,
             explain=lambda: job_story(slurm_env, run, "stage3_sft"))  # fmt: skip
    job = manifest(run)["stage3_sft"]["job_id"]
    subprocess.run(["scontrol", "suspend", job], env=slurm_env, check=True)
    hpcr1(slurm_env, "cancel", str(run))
    wait_for(lambda: "RUNNING" not in hpcr1(slurm_env, "status", str(run)).stdout, "the job to end")
    assert manifest(run)["stage3_sft"]["state"] == "failed"
    assert "failed" in hpcr1(slurm_env, "status", str(run)).stdout

    hpcr1(slurm_env, "resume", str(run), "--cluster", "local")
    wait_for(
        lambda: all_done(run), "the resumed stage", explain=lambda: job_story(slurm_env, run, "stage3_sft")
    )
    stages = manifest(run)
    assert stages["stage1_sft"]["attempts"] == 1, "a done stage was recomputed"
    assert stages["stage3_sft"]["attempts"] == 2
    log = (run / "stage3_sft" / "logs" / "rank-00000.log").read_text()
    resumed = [int(line.rsplit(" ", 1)[1]) for line in log.splitlines() if "resumed from step" in line]
    assert resumed and 10 <= resumed[0] < 50, resumed


def checkpoint_steps(ckpts: Path) -> list[int]:
    return [int(p.name.removeprefix("step-")) for p in ckpts.glob("step-*") if p.is_dir()]


def batch_output(env, script: Path, check: bool = True) -> str:
    """What `script`, run as a 2-task batch job to its end, printed."""
    out = script.with_suffix(".out")
    subprocess.run(["sbatch", "--wait", "--ntasks=2", f"--output={out}", str(script)],
                   env=env, cwd=REPO, capture_output=True, timeout=300, check=check)  # fmt: skip
    return out.read_text()


def stage_srun_output(env, tmp_path: Path, command: str) -> str:
    """`command` run by srun with the stage launcher's options in a 2-task batch job, which then
    prints "srun exit <srun's exit code>"; what the job printed."""
    launcher = srun_command(tmp_path, "stage1_sft", "srun")
    srun = launcher[: launcher.index(sys.executable)]
    script = tmp_path / "job.sh"
    script.write_text(f'#!/bin/bash\n{" ".join(srun)} {command}\necho "srun exit $?"\n')
    return batch_output(env, script)


def test_ranks_leaving_for_the_requeue_at_different_times_end_the_srun_step_with_75(slurm_env, tmp_path):
    """Rank 1 leaves at once, rank 0 tears down for 60 s: srun (with the stage launcher's options)
    TERMs rank 0 when rank 1's 75 comes, and must still report 75, not 143 (which fails the stage).
    Rank 0 marks the end of its teardown: no mark means it was stopped (a wall-clock bound here
    also counted the job's queueing and sbatch's polling, which a loaded machine stretches)."""
    rank, finished = tmp_path / "rank.py", tmp_path / "rank0-ran-its-whole-teardown"
    rank.write_text(
        "import os, time\nfrom runtime.preemption import leave_for_requeue\n"
        "try:\n    leave_for_requeue()\nfinally:\n"
        "    if os.environ['SLURM_PROCID'] == '0':\n"
        f"        time.sleep(60)\n        open({str(finished)!r}, 'w').close()\n"
    )
    output = stage_srun_output(slurm_env, tmp_path, f"{sys.executable} {rank}")
    assert "srun exit 75" in output, output
    assert not finished.exists(), "rank 0 was not stopped: it ran its whole teardown"


def test_a_task_outliving_its_rank_after_the_requeues_exit_is_not_cancelled(slurm_env, tmp_path):
    """A rank in a container ends seconds before its srun task (podman tears the container down). The
    rank met its peers through MPI (PMIx) and leaves without the interpreter's finalisation, as for a
    requeue: Slurm must not take that for a lost PMIx connection and cancel the step, SIGKILLing the
    tasks (137, a failed stage), but report the tasks' 75."""
    rank = "import os; from runtime.dist import rendezvous; rendezvous(); os._exit(75)"
    task = f"{sys.executable} -c {shlex.quote(rank)}; sleep 3; exit 75"
    output = stage_srun_output(slurm_env, tmp_path, f"bash -c {shlex.quote(task)}")
    assert "srun exit 75" in output, output


def test_a_ray_head_that_exits_before_it_answers_is_started_again_then_the_job_fails(slurm_env, tmp_path):
    """The verl job's Ray CLI fails at once (as `ray start --head` does when its raylet misses Ray's
    30 s to register on a loaded node): the head is started twice more, then the job fails saying
    so, not at the profile's ready timeout. The job's Python runs all else."""
    python = tmp_path / "python"
    python.write_text(
        '#!/bin/bash\nif [ "$1 $2" = "-m ray.scripts.scripts" ]; then echo "ray $3 failed" >&2; exit 1; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    profile = load_profile("local")
    script = tmp_path / "job.sh"
    script.write_text(render_verl_script(profile, tmp_path, "stage2_grpo", 1, python=str(python)))
    started = time.monotonic()
    output = batch_output(slurm_env, script, check=False)
    lines = [line for line in output.splitlines() if line.startswith("hpcr1:")]
    assert lines == [
        *(
            f"hpcr1: the Ray head on vm exited before it answered (try {n} of 3); starting it again"
            for n in (1, 2)
        ),
        "hpcr1: error: the Ray head on vm exited before it answered, 3 time(s); see its output above",
    ], output[-3000:]
    assert output.count("ray start failed") == 3
    assert time.monotonic() - started < profile.ray.ready_timeout_s / 2


def test_failed_stage_ends_its_dependants(slurm_env, tmp_path):
    config = {**TWO_STAGES, "name": "fails"}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    # Prepare the inputs, then break the base model so that stage 1 fails while running.
    hpcr1(slurm_env, "submit", str(path), "--cluster", "local", "--run-dir", str(run), "--dry-run")
    (run / "inputs" / "model" / "model.safetensors").write_bytes(b"not a safetensors file")
    hpcr1(slurm_env, "submit", str(path), "--cluster", "local", "--run-dir", str(run))
    wait_for(lambda: manifest(run)["stage1_sft"]["state"] == "failed", "stage 1 to fail")
    second = manifest(run)["stage3_sft"]["job_id"]
    wait_for(
        lambda: (
            second
            not in subprocess.run(
                ["squeue", "-h", "-o", "%i"], env=slurm_env, capture_output=True, text=True
            ).stdout
        ),
        "the dependant to leave the queue",
        timeout=120,
    )
    status = hpcr1(slurm_env, "status", str(run)).stdout
    assert "failed" in status and ("CANCELLED" in status or "DependencyNeverSatisfied" in status), status
