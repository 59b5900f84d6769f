"""The verl stage template (slurm/templates/verl_stage.sbatch) across the nodes of the multi-node
local cluster: the Ray head on the first node and a worker on the other join into one cluster
(`ray status` lists both), and a placement group of verl's worker-group kind (one CPU bundle a node,
STRICT_SPREAD) runs a task on each node, each reporting its own hostname. verl's trainer needs GPUs:
the rendered script stops where it would start the stage, with the probe in its place. The job runs
under a home holding another Ray's auth token, and its head's address is the one Slurm reaches the
first node at."""

from __future__ import annotations

import subprocess
import sys

import pytest

from core.cluster import load_profile
from launch.sbatch import render_verl_script
from tests.conftest import REPO

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
import ray  # noqa: E402, F401  (pinned: a broken install must fail, not skip)

PROBE = """
import os, socket, subprocess, sys, time
import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

address = os.environ["RAY_ADDRESS"]
print("RAY_ADDRESS=" + address, flush=True)
# `ray status` prints the autoscaler's last report, which lags the nodes joining by a few seconds
# (seen: "No cluster status", or one active node while the placement group below spreads over
# two): asked again until it lists both, for at most 60 s; the test reads the last answer.
for _ in range(60):
    status = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "status", "--address", address],
                            capture_output=True, text=True).stdout
    if status.partition("Active:")[2].partition("Pending:")[0].count("node_") == 2:
        break
    time.sleep(1)
print(status, flush=True)
ray.init(address=address, logging_level="ERROR", log_to_driver=False)
# verl's RayResourcePool: one bundle a node, the node's share of CPUs (GPUs on a GPU cluster).
pg = placement_group([{"CPU": 1}] * 2, strategy="STRICT_SPREAD")
ray.get(pg.ready(), timeout=60)

@ray.remote(num_cpus=1)
def where():
    return socket.gethostname()

hosts = ray.get([
    where.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i))
    .remote()
    for i in range(2)
])
print("bundle hosts:", " ".join(hosts), flush=True)
ray.shutdown()
"""


def test_the_verl_template_joins_ray_across_nodes_and_spreads_a_placement_group(multinode_env, tmp_path):
    script = render_verl_script(load_profile("local-multinode"), tmp_path / "run", "stage2_grpo", 2)
    stage_line = next(line for line in script.splitlines() if line.startswith("exec "))
    assert "pipeline.cli stage" in stage_line
    # verl's trainer would start here, and needs GPUs: the probe runs instead.
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    (tmp_path / "job.sbatch").write_text(script.replace(stage_line, f"exec {sys.executable} {probe}"))
    out = tmp_path / "job.out"
    # A Ray started in-process leaves ~/.ray/auth_token, and every node sees the same home: with one
    # there, the job's Ray must start and answer as without it.
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("0123456789abcdef" * 4)
    name = f"ray-probe-{tmp_path.name}"
    try:
        job = subprocess.run(
            ["sbatch", "--wait", f"--job-name={name}", f"--output={out}", str(tmp_path / "job.sbatch")],
            env={**multinode_env, "HOME": str(home)},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:  # a job cut off by the timeout would keep its Ray running on both nodes
        subprocess.run(["scancel", f"--name={name}"], env=multinode_env, capture_output=True, timeout=60)
    text = out.read_text()
    assert job.returncode == 0, text[-4000:]
    assert "Ray cluster ready: 2 node(s)" in text, text[-4000:]
    head = text.split("RAY_ADDRESS=", 1)[1].split(":", 1)[0]
    node = subprocess.run(
        ["scontrol", "show", "node", "mnode1"], env=multinode_env, capture_output=True, text=True
    )
    assert f"NodeAddr={head} " in node.stdout, (head, node.stdout)
    # ray status: both nodes active.
    active = text.split("Active:", 1)[1].split("Pending:", 1)[0]
    assert active.count("node_") == 2, text[-4000:]
    hosts = text.split("bundle hosts:", 1)[1].split()[:2]
    assert sorted(hosts) == ["mnode1", "mnode2"], text[-4000:]
