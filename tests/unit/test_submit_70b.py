"""The study's own run submits: the 70B config, with the layouts `hpcr1 plan` writes for each
Perlmutter node kind, passes `hpcr1 submit --dry-run` and writes every stage's job; on the 40 GB
nodes its SFT is pipelined."""

from __future__ import annotations

import json

import pytest

from core.config import load_config
from pipeline.cli import main
from tests.conftest import REPO

CONFIG_70B = REPO / "configs" / "llama-3.3-70b-perlmutter.yaml"
SHAPE_70B = f"model.path={REPO / 'configs' / 'models' / 'llama-3.3-70b'}"


@pytest.fixture
def data_files(tmp_path):
    row = {"question": "What is 2 plus 2?", "answer": "2 plus 2 is 4.\n#### 4"}
    for name in ("sft", "prompts", "eval"):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
    return [f"data.{name}_file={tmp_path / name}.jsonl" for name in ("sft", "prompts", "eval")]


@pytest.mark.parametrize("cluster, sft_pp", [("perlmutter", 8), ("perlmutter-80g", 1)])
def test_the_70b_config_submits_with_the_planned_layouts(tmp_path, data_files, capsys, cluster, sft_pp):
    plan = tmp_path / "plan.txt"
    argv = ["plan", str(CONFIG_70B), "--cluster", cluster, "--write-overrides", str(plan), SHAPE_70B]
    argv += ["--out", str(tmp_path / "plan.md")]
    assert main(argv) == 0, capsys.readouterr().err
    overrides = plan.read_text().split()
    assert f"stage1_sft.parallel.pp={sft_pp}" in overrides

    run = tmp_path / "run"
    argv = ["submit", str(CONFIG_70B), "--cluster", cluster, "--dry-run", "--run-dir", str(run), SHAPE_70B]
    rc = main([*argv, *data_files, *overrides])
    err = capsys.readouterr().err
    assert rc == 0, err
    stages = load_config(CONFIG_70B, [SHAPE_70B], data_files=False).stages()
    assert len(stages) == 5
    for sid in stages:
        assert (run / sid / "logs" / f"{sid}.sbatch").is_file(), sid
