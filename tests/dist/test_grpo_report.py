"""`hpcr1 report` on a real GRPO stage (2 ranks, profile on): the report holds every phase of the
GRPO step, compares policy update, policy log-probs and reference log-probs side by side, and
credits each FSDP2 phase with the bytes the model's parameters require (counted from the
safetensors file, not from the profiler)."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.conftest import hpcr1_env, markdown_table, seconds
from tests.dist.test_grpo_stage import PHASES, prepared_grpo_run, run_stage

pytestmark = pytest.mark.dist
STEPS, MINI_BATCHES = 2, 2  # prepared_grpo_run's mini_batches; ppo_epochs is 1
PANELS = ("policy_update", "policy_logprob", "reference_logprob")
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


@pytest.fixture(scope="module")
def grpo_report(tmp_path_factory) -> tuple[Path, str]:
    """(the run's base model directory, report.md) after a 2-step GRPO stage and `hpcr1 report`."""
    return reported_run(tmp_path_factory.mktemp("grpo-report"), "fsdp2")


@pytest.fixture(scope="module")
def ddp_report(tmp_path_factory) -> tuple[Path, str]:
    return reported_run(tmp_path_factory.mktemp("ddp-report"), "ddp")


def reported_run(tmp: Path, data_parallel: str) -> tuple[Path, str]:
    run = prepared_grpo_run(tmp, steps=STEPS, data_parallel=data_parallel)
    run_stage(run, "stage2_grpo")
    hpcr1 = Path(sys.executable).with_name("hpcr1")  # the installed console script, as a user runs it
    proc = subprocess.run(
        [str(hpcr1), "report", str(run.root)],
        cwd=tmp,
        env=hpcr1_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str(run.root / "report" / "index.html")
    return run.base_model, (run.root / "report" / "report.md").read_text()


def bytes_by_phase(md: str) -> dict[str, dict[str, float]]:
    header, *rows = markdown_table(md, "Communication bytes by phase and operation (per rank)")
    return {
        row[0]: {op: size_bytes(cell) for op, cell in zip(header[1:], row[1:]) if cell != "0 B"}
        for row in rows
    }


def parameter_bytes(model_dir: Path, in_layers: bool) -> int:
    """fp32 bytes of the model's parameters: all of them, or only the decoder layers'."""
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        return sum(
            4 * math.prod(f.get_slice(n).get_shape()) for n in f.keys() if not in_layers or ".layers." in n
        )


def size_bytes(cell: str) -> float:
    """Inverse of analysis.tables.size ("5.88 MiB" -> bytes), good to the printed digits."""
    number, unit = re.fullmatch(r"([\d.]+) (B|KiB|MiB|GiB)", cell).groups()
    return float(number) * UNITS[unit]


def test_report_shows_every_phase_of_the_grpo_step_with_its_wall_time(grpo_report):
    _, md = grpo_report
    rows = markdown_table(md, "Time by phase (rank 0): compute and exposed communication")
    wall = {row[0]: seconds(row[1]) for row in rows[1:]}
    assert set(PHASES) <= set(wall), sorted(wall)
    assert all(wall[p] > 0 for p in PHASES), wall


def test_weight_sync_gathers_block_the_rank_so_they_count_as_exposed_communication(grpo_report):
    _, md = grpo_report
    split = markdown_table(md, "Time by phase (rank 0): compute and exposed communication")
    exposed = {row[0]: seconds(row[2]) for row in split[1:]}
    header, *rows = markdown_table(md, "Communication time by phase and operation (per rank)")
    gather_s = seconds(next(row for row in rows if row[0] == "weight_sync")[header.index("all_gather")])
    # full_tensor() waits for each gather as soon as it is issued: little of it can hide behind compute
    assert gather_s > 0 and exposed["weight_sync"] >= 0.25 * gather_s, (exposed["weight_sync"], gather_s)


def test_report_compares_policy_update_and_both_log_prob_phases_side_by_side(grpo_report):
    _, md = grpo_report
    header, *rows = markdown_table(md, "GRPO phases side by side: communication per rank over the stage")
    assert header == ["op", *(f"{p} {unit}" for p in PANELS for unit in ("calls", "bytes", "time"))]
    gather = next(row for row in rows if row[0] == "all_gather")
    assert all(float(gather[1 + 3 * i]) > 0 for i in range(len(PANELS))), "FSDP2 gathers in every panel"
    assert "![stage2_grpo-grpo-panels](stage2_grpo-grpo-panels.png)" in md


def test_fsdp2_phases_move_the_bytes_the_parameters_require_and_the_others_move_none(grpo_report):
    model_dir, md = grpo_report
    moved = bytes_by_phase(md)
    every, layers = parameter_bytes(model_dir, in_layers=False), parameter_bytes(model_dir, in_layers=True)
    slack = 1.1  # FSDP2 pads each shard to equal size; the table prints 3 significant digits
    # The rollout's copy of the policy receives every parameter once a step.
    assert STEPS * every / 1.01 <= moved["weight_sync"]["all_gather"] <= STEPS * every * slack
    # A forward gathers every decoder layer (the root unit may stay gathered between no-grad passes).
    for phase in ("policy_logprob", "reference_logprob"):
        assert STEPS * layers / 1.01 <= moved[phase]["all_gather"] <= STEPS * every * slack, phase
    # Each optimizer step reduce-scatters the gradient of every parameter.
    grads = STEPS * MINI_BATCHES * every
    assert grads / 1.01 <= moved["policy_update"]["reduce_scatter"] <= grads * slack
    # Generation runs on the rollout's own unsharded copy; scoring and advantages are local.
    assert not {"rollout", "reward", "advantage"} & set(moved), sorted(moved)


def test_ddp_moves_only_each_mini_batchs_gradients(ddp_report):
    """Whole models on every rank: the weight sync and the log-prob passes communicate nothing, and
    each optimizer step all-reduces the gradient of every parameter once (plus a few bytes of token
    counts and statistics, and DDP's broadcast of its bucket order after the first backward)."""
    model_dir, md = ddp_report
    moved = bytes_by_phase(md)
    grads = STEPS * MINI_BATCHES * parameter_bytes(model_dir, in_layers=False)
    assert {op for op, size in moved["policy_update"].items() if size > 1024} == {"all_reduce"}, moved[
        "policy_update"
    ]
    assert grads / 1.01 <= moved["policy_update"]["all_reduce"] <= grads * 1.01 + 1024
    assert not {"weight_sync", "reference_logprob", "policy_logprob", "rollout"} & set(moved), sorted(moved)
