"""With eval.engine 'verl', a stage's own ranks train and export final/ but do not score it: verl's
generation server does that once they exit (launch/verl_job.run_then_eval_on_verl), so the ranks
must neither load the whole model for eval nor leave an eval.json of their own behind."""

from __future__ import annotations

import pytest
import yaml

from core.config import load_config
from core.rundir import RunDir
from launch.local import run_stage_locally
from pipeline.driver import check_run, write_run
from tests.conftest import SMALL_RUN

pytestmark = pytest.mark.dist


def test_ranks_export_final_and_leave_the_held_out_eval_to_verl(tmp_path):
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump({**SMALL_RUN, "eval": {**SMALL_RUN["eval"], "engine": "verl"}}))
    cfg = load_config(path)
    run = RunDir(tmp_path / "run")
    write_run(cfg, run, check_run(cfg, tmp_path), tmp_path)

    assert run_stage_locally(run.root, "stage1_sft", cfg.nproc) == 0
    assert any(run.final("stage1_sft").glob("*.safetensors"))
    assert not run.eval_result("stage1_sft").exists()
    logs = "".join(p.read_text() for p in run.logs("stage1_sft").glob("rank-*.log"))
    assert "accuracy of final/" not in logs
