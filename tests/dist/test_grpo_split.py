"""stage2_grpo with its rollout on a rank of its own (rollout_ranks=1: one generator; stages/grpo/
split.py), against the stage on ranks that generate and train in turn: at staleness 0 it computes
exactly what they compute (the weights and the batches cross over unchanged, a generator serving
two trainers); at staleness 1 each batch was sampled with the weights of the step before, which the
importance ratio sees; the weight hand-over moves the model's parameter bytes once a step, and the
report sets the generator's time beside the trainer's, its timeline the sampling under the training."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from analysis.events import load_events
from analysis.tables import size
from analysis.timeline import GENERATION_TID, STEPS_TID
from launch.local import torchrun_command
from runtime.preemption import PREEMPTED_EXIT
from tests.conftest import REPO, hpcr1_run, markdown_table, resumed_steps, seconds, tiny_base_of
from tests.dist.test_rank_failure import wait_until

pytestmark = pytest.mark.dist

STEPS = 4
SPLIT_GRPO = (
    f"stage2_grpo.steps={STEPS}",
    "stage2_grpo.checkpoint_every=2",
    "stage2_grpo.prompts_per_step=4",
    "stage2_grpo.group_size=4",
    "stage2_grpo.max_new_tokens=24",
    # an update large enough for one step's weights to sample differently from the next's
    "stage2_grpo.lr=1e-3",
    "stage2_grpo.temperature=1.5",
    "stage2_grpo.format_reward=1.0",
    # the old policy's log-probs from the actor: the importance ratio compares them with the rollout's
    "stage2_grpo.old_log_probs=actor",
    "stage2_grpo.rollout_ranks=1",
    "stage2_grpo.data_parallel=ddp",
    "profile.comm=true",
)
# What a GRPO step computed: the rollout's, the reward's and the update's.
GRPO_RESULTS = (
    *("reward/mean", "response_length/mean", "entropy"),
    *("actor/kl", "actor/pg_loss", "actor/grad_norm"),
)


@pytest.fixture(scope="module")
def split_runs(trained_runs, tmp_path_factory) -> dict:
    """{staleness: run directory, "colocated": its reference}: at staleness 1 through `hpcr1 run`
    (1 generator, 1 trainer); at staleness 0 without the correction (nothing to correct) on 3 ranks,
    a generator serving 2 trainers; the reference on 2 ranks that generate and train."""
    root = tmp_path_factory.mktemp("grpo-split")
    runs = {1: root / "staleness-1"}
    trained_runs.get().continue_into(runs[1], *SPLIT_GRPO, stages=("stage2_grpo",))
    runs[0] = twin(runs[1], root / "staleness-0", 3, max_staleness=0, importance_cap=None)
    runs["colocated"] = twin(runs[1], root / "colocated", 2, rollout_ranks=0)
    return runs


def twin(run: Path, run_dir: Path, nproc: int, **changes) -> Path:
    """`run`'s stage 2 again on `nproc` ranks with `changes` to its fields, from the same inputs,
    started as the driver starts a stage's ranks."""
    shutil.copytree(run, run_dir, ignore=shutil.ignore_patterns("stage2_grpo"))
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["stage2_grpo"] |= changes
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(torchrun_command(run_dir, "stage2_grpo", nproc=nproc), cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, (run_dir / "stage2_grpo" / "logs" / "rank-00000.log").read_text()[-3000:]
    return run_dir


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "stage2_grpo" / "metrics.jsonl").read_text().splitlines()]


def test_at_staleness_0_the_split_computes_what_colocated_ranks_compute(split_runs):
    """Two trainers served by one generator against two ranks that generate and train: each
    trainer's batches are sampled from its own seed stream, as its colocated rank's are."""
    split, colocated = split_runs[0], split_runs["colocated"]
    ours, reference = metrics(split), metrics(colocated)
    assert [m["step"] for m in ours] == list(range(1, STEPS + 1))
    for key in GRPO_RESULTS:
        assert [m[key] for m in ours] == [m[key] for m in reference], key
    assert any(m["actor/grad_norm"] > 0 for m in ours), "no step had a gradient: nothing was compared"
    before, after = (load_file(d / "stage2_grpo" / "final" / "model.safetensors") for d in (colocated, split))
    assert before.keys() == after.keys() and all(before[k].equal(after[k]) for k in before)
    # the behaviour policy is the old one: the importance ratio is 1 but for rounding
    assert [m["rollout/weights_version"] for m in ours] == list(range(STEPS))
    for m in ours:
        assert m["importance/mean"] == pytest.approx(1, abs=1e-5), m
        assert m["importance/max"] == pytest.approx(1, abs=1e-4), m


def test_at_staleness_1_each_batch_was_sampled_with_the_weights_of_the_step_before(split_runs):
    steps = metrics(split_runs[1])
    # the first two batches with the initial weights, then step s's with step s - 1's
    assert [m["rollout/weights_version"] for m in steps] == [0, *range(STEPS - 1)]
    assert [m["rollout/staleness"] for m in steps] == [0, *[1] * (STEPS - 1)]
    # a stale batch's tokens are less likely under the weights one update later: the ratio departs from 1
    assert steps[0]["importance/max"] == pytest.approx(1, abs=1e-4)
    assert max(m["importance/max"] for m in steps[1:]) > 1.01, steps
    assert all(0 <= m["importance/capped"] < 1 for m in steps)


@pytest.mark.parametrize("staleness", [0, 1])
def test_the_weight_hand_over_moves_the_models_parameter_bytes_once_a_step(split_runs, staleness):
    run = split_runs[staleness]
    model = AutoModelForCausalLM.from_pretrained(run / "stage2_grpo" / "final", dtype=torch.float32)
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    sent: dict[int, int] = {}
    for event in load_events(run / "stage2_grpo"):
        if event["phase"] == "weight_sync" and event["rank"] == 0:
            assert event["op"] == "broadcast" and event["group_size"] == 2, event
            sent[event["step"]] = sent.get(event["step"], 0) + event["bytes"]
    # a step's weights go where a later batch is still to be sampled with them
    assert sent == {step: parameter_bytes for step in range(1, STEPS - staleness + 1)}


def test_the_report_sets_the_generators_time_beside_the_trainers(split_runs, tmp_path):
    run = split_runs[1]
    out = tmp_path / "report"
    subprocess.run([sys.executable, "-m", "pipeline.cli", "report", str(run), "--out", str(out)],
                   cwd=REPO, check=True, capture_output=True)  # fmt: skip
    report = (out / "report.md").read_text()
    stage1, stage2 = report.split("### stage1_sft\n", 1)[1].split("### stage2_grpo\n", 1)
    assert "Generation on ranks of its own" not in stage1  # colocated: no sides to set apart
    title = f"Generation on ranks of its own: seconds a step (mean of {STEPS}; staleness 1)"
    rows = {row[1]: row[2] for row in markdown_table(stage2, title)[1:]}
    steps = metrics(run)
    generating = sum(m["rollout/generation_s"] for m in steps) / STEPS
    assert seconds(rows["sampling and sending a batch"]) == pytest.approx(generating, rel=1e-3)
    model = AutoModelForCausalLM.from_pretrained(run / "stage2_grpo" / "final", dtype=torch.float32)
    per_sync = size(sum(p.numel() * p.element_size() for p in model.parameters()))
    assert f"weight hand-over ({per_sync} a sync, {STEPS - 1} syncs)" in rows, rows
    # the timeline: the sampling of step n's batch begins while step n - 1 trains (staleness 1)
    trace = json.loads((out / "timeline.json").read_text())["traceEvents"]
    pid = next(e["pid"] for e in trace if e.get("args", {}).get("name") == "stage2_grpo: rank 0")
    on = lambda tid: {e["args"]["step"]: e for e in trace if (e["pid"], e["tid"], e["ph"]) == (pid, tid, "X")}  # noqa: E731
    trained, sampled = on(STEPS_TID), on(GENERATION_TID)  # each step's wall time (metrics.jsonl)
    assert sorted(sampled) == sorted(trained) == list(range(1, STEPS + 1))
    for n in range(2, STEPS + 1):
        before = trained[n - 1]
        assert before["ts"] < sampled[n]["ts"] < before["ts"] + before["dur"], (n, before, sampled[n])


def test_usr1_stops_the_split_stage_with_the_batch_sent_ahead_and_it_resumes_there(trained_runs, tmp_path):
    """The signal reaches both ranks at a step boundary: the checkpoint keeps the batch the generator
    had sent for the next step, the next attempt trains on it, and every step is logged once."""
    trained, run_dir, steps = trained_runs.get(), tmp_path / "run", 40
    trained.copy_to(run_dir)
    overrides = (*trained.overrides, "--only", "stage1_sft,stage2_grpo", *SPLIT_GRPO,
                 f"stage2_grpo.steps={steps}", f"stage2_grpo.checkpoint_every={steps}")  # fmt: skip
    again = lambda **kw: hpcr1_run(run_dir, *overrides, config=trained.config,  # noqa: E731
                                   tiny_base=tiny_base_of(trained.path), **kw)  # fmt: skip
    proc = again(wait=False)
    logged = lambda: len(metrics(run_dir)) if (run_dir / "stage2_grpo" / "metrics.jsonl").exists() else 0  # noqa: E731
    wait_until(lambda: logged() >= 5, proc, "5 steps")
    proc.send_signal(signal.SIGUSR1)
    output = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode == PREEMPTED_EXIT, output[-3000:]
    stopped_at = metrics(run_dir)[-1]["step"]
    assert 5 <= stopped_at < steps
    kept = torch.load(
        run_dir / "stage2_grpo" / "ckpt" / f"step-{stopped_at:06d}" / "pending-batches-rank00000.pt"
    )
    assert list(kept) == [stopped_at]  # the next step's batch (0-based), sampled with this step's weights

    again()
    assert resumed_steps(run_dir, "stage2_grpo") == [stopped_at]
    assert [m["step"] for m in metrics(run_dir)] == list(range(1, steps + 1))
    assert [m["rollout/weights_version"] for m in metrics(run_dir)] == [0, *range(steps - 1)]
