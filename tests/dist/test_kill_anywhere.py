"""The whole pipeline killed with SIGKILL (driver, torchrun and ranks) inside a step of four stages,
each time after a checkpoint so that resuming repeats steps, and resumed with `hpcr1 run`: the
weights of every stage and the synthetic data equal an uninterrupted run's byte for byte, each
step is logged once, and no rank outlives a kill. The harness is bench/kill_anywhere.py's, at four
chosen points. stage2_grpo generates on a rank of its own, a step ahead (stages/grpo/split.py: its
checkpoints keep the batch sent ahead); stage4_grpo generates and trains on both. The uninterrupted
run's checkpoints and final/ also take the bytes `hpcr1 submit` plans for them (analysis/disk.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from analysis.disk import run_disk
from analysis.model_shape import model_shape
from bench.kill_anywhere import kill_and_resume, pipeline_overrides, point_at, run_to_end, verdict
from core.config import load_resolved
from core.rundir import RunDir

pytestmark = [pytest.mark.dist, pytest.mark.slow]

# (stage index, steps logged): one step past a checkpoint of stage1_sft (every 10 steps),
# stage2_grpo, stage3_sft and stage4_grpo (every 2).
KILLED_AFTER = [(0, 11), (1, 3), (3, 3), (4, 3)]
SPLIT_GRPO = ("stage2_grpo.rollout_ranks=1", "stage2_grpo.max_staleness=1")


@pytest.mark.timeout(3600)
def test_killed_pipeline_resumes_to_the_uninterrupted_weights(tmp_path):
    overrides = [*pipeline_overrides(nproc=2), *SPLIT_GRPO]
    timeline, _ = run_to_end(tmp_path / "uninterrupted", overrides, tmp_path / "uninterrupted.log")
    assert_written_as_planned(tmp_path / "uninterrupted")
    # The first time the run had got at least that far: at tens of steps a second, a step can
    # pass between two polls of the progress and never be seen on its own.
    points = [point_at(timeline, min(t for t, p in timeline if p >= after) + 0.1) for after in KILLED_AFTER]

    hit, outlived = kill_and_resume(tmp_path / "killed", overrides, points, tmp_path)
    run_to_end(tmp_path / "killed", overrides, tmp_path / "final-resume.log")

    assert hit == ["stage1_sft", "stage2_grpo", "stage3_sft", "stage4_grpo"], (
        "a kill missed its stage: nothing was tested there"
    )
    assert outlived == 0, "ranks outlived the SIGKILL of `hpcr1 run`'s process group"
    assert verdict(tmp_path / "uninterrupted", tmp_path / "killed")


def assert_written_as_planned(run_dir: Path) -> None:
    """Each stage's kept checkpoints and final/ against analysis/disk.py's bytes for them (within
    15%: the plan counts tensors, not the files' headers, RNG states and checksums); synthesis's
    data within its planned bound."""
    cfg = load_resolved(RunDir(run_dir))
    for plan in run_disk(cfg, model_shape(cfg, run_dir).params(), on_gpu=False):
        stage = run_dir / plan.stage
        if plan.checkpoint_bytes:
            steps = sorted((stage / "ckpt").glob("step-*"))
            assert len(steps) == plan.checkpoints - 1, (plan.stage, steps)  # the kept ones, at the end
            written = sum(size_of(step) for step in steps) / len(steps)
            assert written == pytest.approx(plan.checkpoint_bytes, rel=0.15), (plan, written)
            assert size_of(stage / "final") == pytest.approx(plan.final_bytes, rel=0.15), plan
        else:
            assert 0 < size_of(stage / "final") <= plan.final_bytes, plan


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
