"""The pipeline across the nodes of the multi-node local cluster: `hpcr1 submit --cluster
local-multinode`, one rank a node, with no SLURM_CONF exported (the profile names it). Each rank
runs on its own node and says so; under srun's pmix the ranks find each other through mpi4py across
the nodes; the communication profile holds the same collectives on both hosts; and stage 1's final
weights are byte-identical to a one-node run of the same two ranks (gloo, the same CPU)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.conftest import SMALL_RUN
from tests.slurm.test_slurm_pipeline import hpcr1, job_story, manifest, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
TWO_STAGES = {
    **SMALL_RUN,
    "name": "multinode",
    "stage3_sft": {**SMALL_RUN["stage1_sft"], "init_from": "stage1_sft"},
}
RANK_LINE = re.compile(
    r"rank (\d) of 2 on cpu \(gloo\), host (\S+) address (\S+), master (\S+):\d+, ranks from (\w+)"
)


def one_node_profile(tmp_path: Path) -> Path:
    """local-multinode with both ranks on one node: the same launcher, cluster and CPU, one host."""
    profile = yaml.safe_load((Path(__file__).parents[2] / "slurm/profiles/local-multinode.yaml").read_text())
    path = tmp_path / "one-node.yaml"
    path.write_text(yaml.safe_dump({**profile, "name": "local-one-node", "ranks_per_node": 2}))
    return path


@pytest.fixture(scope="module")
def runs(multinode_env, tmp_path_factory):
    """Both runs submitted at once (Slurm runs them one after the other: they need the same cores)."""
    env = {k: v for k, v in multinode_env.items() if k != "SLURM_CONF"}
    tmp = tmp_path_factory.mktemp("multinode")
    config = tmp / "config.yaml"
    config.write_text(yaml.safe_dump(TWO_STAGES))
    two, one = tmp / "two-nodes", tmp / "one-node"
    hpcr1(env, "submit", str(config), "--cluster", "local-multinode", "--run-dir", str(two))
    cluster = str(one_node_profile(tmp))
    hpcr1(env, "submit", str(config), "--cluster", cluster, "--only", "stage1_sft", "--run-dir", str(one))
    return env, two, one


def ended(run: Path, stages: list[str]) -> bool:
    return all(manifest(run)[s]["state"] in ("done", "failed") for s in stages)


def rank_lines(run: Path, stage: str) -> list[tuple[str, ...]]:
    logs = sorted((run / stage / "logs").glob("rank-*.log"))
    return [RANK_LINE.search(log.read_text()).groups() for log in logs]


def test_the_stages_run_with_one_rank_on_each_node(runs):
    env, two, _ = runs
    stages = ["stage1_sft", "stage3_sft"]
    wait_for(lambda: ended(two, stages), "both stages", explain=lambda: job_story(env, two, "stage3_sft"))
    assert all(manifest(two)[s]["state"] == "done" for s in stages), job_story(env, two, "stage3_sft")
    for stage in stages:
        # pmix (the cluster's MpiDefault): the ranks came from MPI, across the nodes.
        assert rank_lines(two, stage) == [
            ("0", "mnode1", "10.213.17.11", "mnode1", "mpi"),
            ("1", "mnode2", "10.213.17.12", "mnode1", "mpi"),
        ]


def test_the_communication_profile_holds_the_same_collectives_on_both_hosts(runs):
    env, two, _ = runs
    wait_for(lambda: ended(two, ["stage1_sft"]), "stage 1", explain=lambda: job_story(env, two, "stage1_sft"))
    profile = two / "stage1_sft" / "profile"
    events = {
        rank: [json.loads(line) for line in (profile / f"rank-{rank:05d}.jsonl").read_text().splitlines()]
        for rank in (0, 1)
    }
    gloo = {
        rank: {(e["op"], e["seq"]) for e in rows if e["backend"] == "gloo" and e["group_ranks"] == [0, 1]}
        for rank, rows in events.items()
    }
    assert any(op == "all_reduce" for op, _ in gloo[0]) and gloo[0] == gloo[1]
    assert {e["rank"] for e in events[1]} == {1}
    assert any(e["phase"] == "bootstrap" and e["backend"] == "mpi" for e in events[1])


def test_stage1_weights_match_a_one_node_run_byte_for_byte(runs):
    env, two, one = runs
    wait_for(
        lambda: ended(one, ["stage1_sft"]),
        "the one-node run",
        explain=lambda: job_story(env, one, "stage1_sft"),
    )
    wait_for(lambda: ended(two, ["stage1_sft"]), "the two-node run")
    assert [host for _, host, *_ in rank_lines(one, "stage1_sft")] == ["mnode1", "mnode1"]
    weights = [run / "stage1_sft" / "final" / "model.safetensors" for run in (two, one)]
    assert weights[0].read_bytes() == weights[1].read_bytes(), weight_difference(*weights)


def weight_difference(a: Path, b: Path) -> str:
    """Which tensors differ and by how much, for the failure message."""
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    diffs = {k: (x[k].double() - y[k].double()).abs().max().item() for k in x if not x[k].equal(y[k])}
    return f"{len(diffs)} of {len(x)} tensors differ; largest |diff| by tensor: {diffs}"
