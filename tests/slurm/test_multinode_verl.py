"""A verl GRPO stage across the 2 nodes of the multi-node local cluster (`--cluster
local-multinode`, one rank a node, verl's CPU platform), trained by verl's own asynchronous trainer
(`rollout_ranks: 1`: trainer.v1 separate_async): the template's Ray head on the first node, at the
address Slurm reaches that node at, and a Ray worker on the second join into one cluster; verl places
the FSDP trainer on one node and the rollout pool on the other, and hands the weights over between
them after every step (the gloo checkpoint engine, stages/engines/verl_gloo_weights.py). The stage ends
done, its final/ and held-out eval written. The job runs under a home holding another Ray's auth
token (every node sees the same home): its Ray must start and answer as without it."""

from __future__ import annotations

import gzip
import json
import re
import subprocess

import pytest
import yaml

from tests.slurm.test_slurm_pipeline import hpcr1, job_story, manifest, wait_for
from tests.slurm.test_slurm_verl import VERL_CHAIN_TIMEOUT_S, verl_config

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.verl_chain,
    pytest.mark.timeout(VERL_CHAIN_TIMEOUT_S),
]
import verl  # noqa: E402, F401  (pinned: a broken install must fail, not skip)

STEPS = 3


def test_verls_async_trainer_trains_on_one_node_and_generates_on_the_other(multinode_env, tmp_path):
    home = tmp_path / "home"  # a Ray started in-process leaves ~/.ray/auth_token
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("0123456789abcdef" * 4)
    env = {**{k: v for k, v in multinode_env.items() if k != "SLURM_CONF"}, "HOME": str(home)}
    config = tmp_path / "config.yaml"
    split = ("stage2_grpo.init_from=base", "stage2_grpo.rollout_ranks=1", f"stage2_grpo.steps={STEPS}")
    config.write_text(yaml.safe_dump(verl_config(*split, stages=("stage2_grpo",))))
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
    # the head's own line for joining it: `ray start --address='HEAD:PORT'`
    head = re.search(r"ray start --address='([^':]+):", job_output).group(1)
    node = subprocess.run(
        ["scontrol", "show", "node", "mnode1"], env=multinode_env, capture_output=True, text=True
    )
    assert f"NodeAddr={head} " in node.stdout, (head, node.stdout)
    # verl's torch-profiler traces name the trainer's host; the rollout server names its own as it
    # takes each step's weights: the initial ones, then those of every step
    trainer = {
        json.loads(gzip.decompress(t.read_bytes()))["host_name"]
        for t in (run / sid / "verl_traces").glob("*.json.gz")
    }
    log = (run / sid / "logs" / "rank-00000.log").read_text(errors="replace")
    handed = re.findall(r"hf rollout on (\S+): the weights of step (\d+)", log)
    rollout = {host for host, _ in handed}
    assert len(trainer) == 1 and len(rollout) == 1 and trainer | rollout == {"mnode1", "mnode2"}, (
        trainer,
        handed,
    )
    # (Ray streams some lines twice, or folds repeats: the steps, not the count of lines)
    assert sorted({int(step) for _, step in handed}) == list(range(STEPS + 1)), handed
    metrics = [json.loads(line) for line in (run / sid / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in metrics] == list(range(1, STEPS + 1))
    assert all(row["phase_time/weight_sync"] > 0 for row in metrics), metrics
    # verl's `gen` timer is the trainer's wait for sampled batches here, not their sampling
    assert all(
        row["phase_time/rollout_wait"] == row["timing_s/gen"] and "phase_time/rollout" not in row
        for row in metrics
    )
    # a batch trained at most max_staleness (1) versions after the weights that generated it
    assert all(row["training/off_policy/trajectory_staleness/max"] <= 1 for row in metrics), metrics
