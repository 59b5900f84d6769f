"""`hpcr1 submit` holds the run directory's file system against what the stages will write
(analysis/disk.py): a file system too small, or short of inodes, is refused before anything is
written or queued, naming the planned and the free figures; --skip-checks submits anyway. The file
systems are small tmpfs mounts made here (root)."""

from __future__ import annotations

import subprocess

import pytest

from analysis.disk import run_disk
from analysis.model_shape import tiny_shape
from core.config import load_config
from pipeline.cli import main
from tests.conftest import REPO

TINY = REPO / "configs" / "tiny-cpu.yaml"


@pytest.fixture
def small_fs(tmp_path):
    """mount(options) -> a tmpfs mounted at a fresh directory, unmounted after the test."""
    mounted = []

    def mount(options: str):
        where = tmp_path / f"fs{len(mounted)}"
        where.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], check=True)
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], check=True)


def planned_bytes() -> int:
    cfg = load_config(TINY)
    return sum(s.total_bytes for s in run_disk(cfg, tiny_shape(cfg.model.tiny).params(), on_gpu=False))


def submit(run, *extra: str) -> list[str]:
    """A submission refused before it reaches sbatch, or (--dry-run) written and not submitted."""
    return ["submit", str(TINY), "--cluster", "local", "--run-dir", str(run), *extra]


def test_a_run_directory_too_small_for_the_checkpoints_is_refused_naming_both_figures(small_fs, capsys):
    fs = small_fs(f"size={planned_bytes() // 2}")
    assert main(submit(fs / "run")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hpcr1: error: --run-dir: run directory space FAIL: ") and "\n" not in err, err
    assert f"free on {fs}" in err and "planned (stage" in err and "keep_checkpoints" in err, err
    assert not (fs / "run").exists()
    # A dry run, which submits nothing, says it; --skip-checks: the user knows better (a file system
    # that grows, a quota about to rise)
    assert main(submit(fs / "run", "--dry-run")) == 0
    assert "FAIL  run directory space: " in capsys.readouterr().out
    assert main(submit(fs / "run", "--dry-run", "--skip-checks")) == 0
    assert "run directory" not in capsys.readouterr().out
    assert (fs / "run" / "stage1_sft" / "logs" / "stage1_sft.sbatch").is_file()


def test_too_few_inodes_fail_and_a_tight_fit_warns(small_fs, capsys):
    need = planned_bytes()
    assert main(submit(small_fs(f"size={2 * need},nr_inodes=20") / "run")) == 2
    assert "run directory inodes FAIL: " in capsys.readouterr().err
    tight = small_fs(f"size={int(1.1 * need)}")
    assert main(submit(tight / "run", "--dry-run")) == 0
    assert "WARN  run directory space: " in capsys.readouterr().out


def test_only_the_stages_still_to_run_count(small_fs, capsys):
    """The stages a resubmission skips (done) write nothing more: --only one small stage fits."""
    cfg = load_config(TINY)
    sft = run_disk(cfg, tiny_shape(cfg.model.tiny).params(), on_gpu=False, stages=["stage3_synth"])
    fs = small_fs(f"size={4 * sft[0].total_bytes + 2**20}")
    assert main(submit(fs / "run", "--only", "stage3_synth", "--dry-run")) == 0, capsys.readouterr().err
    assert "run directory" not in capsys.readouterr().out
    assert main(submit(fs / "run", "--dry-run")) == 0  # every stage: far more than it holds
    assert "FAIL  run directory space: " in capsys.readouterr().out
