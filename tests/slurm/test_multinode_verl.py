"""A verl GRPO stage across the 2 nodes of the multi-node local cluster (`--cluster
local-multinode`, one rank a node, verl's CPU platform): the template's Ray head on the first node,
at the address Slurm reaches that node at, and a Ray worker on the second join into one cluster;
verl's trainer places one FSDP rank (and one rollout replica) on each (their profiler traces name
the hosts), and the stage ends done, its final/ and held-out eval written. The job runs under a
home holding another Ray's auth token (every node sees the same home): its Ray must start and
answer as without it."""

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


def test_a_verl_grpo_stage_spans_both_nodes(multinode_env, tmp_path):
    home = tmp_path / "home"  # a Ray started in-process leaves ~/.ray/auth_token
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("0123456789abcdef" * 4)
    env = {**{k: v for k, v in multinode_env.items() if k != "SLURM_CONF"}, "HOME": str(home)}
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
    # the head's own line for joining it: `ray start --address='HEAD:PORT'`
    head = re.search(r"ray start --address='([^':]+):", job_output).group(1)
    node = subprocess.run(
        ["scontrol", "show", "node", "mnode1"], env=multinode_env, capture_output=True, text=True
    )
    assert f"NodeAddr={head} " in node.stdout, (head, node.stdout)
    # verl's torch-profiler traces name each FSDP rank's host: one rank on each node
    hosts = {}
    for trace in (run / sid / "verl_traces").glob("*.json.gz"):
        header = json.loads(gzip.decompress(trace.read_bytes()))
        hosts[header["distributedInfo"]["rank"]] = header["host_name"]
    assert sorted(hosts.values()) == ["mnode1", "mnode2"], hosts
