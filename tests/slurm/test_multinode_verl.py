"""A verl GRPO stage across the 2 nodes of the multi-node local cluster (`--cluster
local-multinode`, one rank a node, verl's CPU platform): the template's Ray head on the first node
and a Ray worker on the second join into one cluster, verl's trainer places one FSDP rank (and one
rollout replica) on each, and the stage ends done, its final/ and held-out eval written."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.slurm.test_slurm_pipeline import hpcr1, job_story, manifest, wait_for
from tests.slurm.test_slurm_verl import verl_config

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.verl_chain]
pytest.importorskip("verl")


def test_a_verl_grpo_stage_spans_both_nodes(multinode_env, tmp_path):
    env = {k: v for k, v in multinode_env.items() if k != "SLURM_CONF"}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(verl_config("stage2_grpo.init_from=base", stages=("stage2_grpo",))))
    run = tmp_path / "run"
    hpcr1(env, "submit", str(config), "--cluster", "local-multinode", "--run-dir", str(run))
    sid = "stage2_grpo"
    try:
        wait_for(lambda: manifest(run)[sid]["state"] in ("done", "failed"), sid, timeout=1200,
                 explain=lambda: job_story(env, run, sid))  # fmt: skip
    finally:  # a job left running would hold the profile's Ray ports on both nodes
        hpcr1(env, "cancel", str(run), check=False)
    assert manifest(run)[sid]["state"] == "done", job_story(env, run, sid)
    assert json.loads((run / sid / "eval.json").read_text())["n"] == 8
    job_output = "".join(p.read_text() for p in (run / sid / "logs").glob("slurm-*.out"))
    assert "Ray cluster ready: 2 node(s)" in job_output
    # Ray prefixes each remote actor's output with its node's address: verl's ranks ran on both.
    log = (run / sid / "logs" / "rank-00000.log").read_text()
    rank_nodes = set(re.findall(r"\(WorkerDict pid=\d+, ip=([\d.]+)\)", log))
    assert len(rank_nodes) == 2, rank_nodes
