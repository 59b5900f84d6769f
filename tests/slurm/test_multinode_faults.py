"""Faults of a node in the middle of a 2-node stage, on the multi-node local cluster, each with
nothing lost. Node 2's link cut (its veth down: its rank lives on, unreachable) or its slurmd killed:
every rank of the stage exits within FAULT_BOUND_S (Slurm's SlurmdTimeout ends the srun step, the
profile's collective_timeout_s the rank cut off behind the dead link), the stage is marked failed
with the node named in `hpcr1 status`, and once the node is back `hpcr1 resume` finishes the stage
from its last checkpoint, with final weights byte-identical to an uninterrupted run. A preemption
(USR1, then the requeue) of the 2-node stage resumes the same way."""

from __future__ import annotations

import functools
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import SMALL_RUN
from tests.slurm.multinode import bring_back, cut_link, kill_slurmd, workers_on
from tests.slurm.test_multinode_pipeline import one_node_profile, weight_difference
from tests.slurm.test_slurm_pipeline import hpcr1, job_story, manifest, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
# ~11 steps a second at most: after the fault at step ~30 the stage must outlast its detection (a
# killed slurmd leaves the ranks training until Slurm sets the node DOWN, ~20 s) by a margin.
FAULTS = {
    **SMALL_RUN,
    "name": "faults",
    "stage1_sft": {**SMALL_RUN["stage1_sft"], "steps": 320, "checkpoint_every": 25},
}
FAULT_AT_STEP = 30  # after the step-25 checkpoint
# The node DOWN (~20 s: start-multinode.sh), or the collective timeout (20 s), and slack for
# two loaded shared cores. Before the fix: the cut-off rank waited 30 minutes in gloo.
FAULT_BOUND_S = 60


@pytest.fixture(scope="module")
def env(multinode_env):
    return multinode_env  # SLURM_CONF for scancel and job_story; hpcr1 takes the profile's


@pytest.fixture(scope="module")
def reference(env, tmp_path_factory):
    """The uninterrupted run: both ranks on node 1 (byte-identical to two nodes:
    test_multinode_pipeline), submitted first and left to run beside the faults on node 2."""
    tmp = tmp_path_factory.mktemp("reference")
    profile = one_node_profile(tmp)
    data = yaml.safe_load(profile.read_text())
    profile.write_text(yaml.safe_dump({**data, "extra_directives": ["--nodelist=mnode1"]}))
    run = submit(env, tmp, FAULTS, str(profile))
    return run / "stage1_sft" / "final" / "model.safetensors"


def submit(env, tmp: Path, config: dict, cluster: str = "local-multinode") -> Path:
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    run = tmp / "run"
    hpcr1(env, "submit", str(path), "--cluster", cluster, "--run-dir", str(run))
    return run


def steps_done(run: Path) -> int:
    metrics = run / "stage1_sft" / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def ended(run: Path, attempt: int = 1) -> bool:
    """The stage's `attempt` ended (a resubmitted stage says "failed" until its new job starts)."""
    entry = manifest(run)["stage1_sft"]
    return entry["attempts"] == attempt and entry["state"] in ("done", "failed")


def same_weights(env, run: Path, reference: Path) -> None:
    wait_for(lambda: reference.exists(), "the uninterrupted run", timeout=300)
    final = run / "stage1_sft" / "final" / "model.safetensors"
    assert final.read_bytes() == reference.read_bytes(), weight_difference(final, reference)


def resumed_from(run: Path) -> list[int]:
    log = (run / "stage1_sft" / "logs" / "rank-00000.log").read_text()
    return [int(line.rsplit(" ", 1)[1]) for line in log.splitlines() if "resumed from step" in line]


def fault_story(env, run: Path) -> str:
    return f"ranks: node 1 {workers_on(1)}, node 2 {workers_on(2)}\n" + job_story(env, run, "stage1_sft")


def failed_in_status(env, run: Path) -> bool:
    """The stage shows failed to `hpcr1 status`, which is also what fails a job orphaned by its lost
    batch host: no driver is left to record it."""
    hpcr1(env, "status", str(run))
    return ended(run)


@pytest.mark.parametrize(
    "fault, node",
    [
        pytest.param(cut_link, 2, id="link_cut"),
        pytest.param(kill_slurmd, 2, id="slurmd_killed"),
        # The first node runs the batch script, the stage driver: nothing is left to record the failure.
        pytest.param(cut_link, 1, id="batch_host_link_cut"),
    ],
)
def test_a_lost_node_fails_the_stage_in_bounded_time_and_resume_finishes_it(
    fault, node, env, reference, tmp_path
):
    run = submit(env, tmp_path, FAULTS)
    if node == 1:
        wait_for(lambda: reference.exists(), "the uninterrupted run (on node 1)", timeout=300)
    wait_for(lambda: steps_done(run) >= FAULT_AT_STEP, "training to pass step 30", timeout=300)
    faulted = time.monotonic()
    fault(node)
    try:
        explain = functools.partial(fault_story, env, run)
        wait_for(
            lambda: not workers_on(1) and not workers_on(2), "every rank to exit", FAULT_BOUND_S, explain
        )
        ranks_gone = time.monotonic() - faulted
        wait_for(lambda: failed_in_status(env, run), "the stage to fail", FAULT_BOUND_S - ranks_gone, explain)
        print(
            f"{fault.__name__}({node}): every rank gone {ranks_gone:.1f} s and the stage failed "
            f"{time.monotonic() - faulted:.1f} s after the fault"
        )
        entry = manifest(run)["stage1_sft"]
        assert entry["state"] == "failed" and f"mnode{node}" in entry["error"]["lost_nodes"], entry
        status = hpcr1(env, "status", str(run)).stdout
        assert "failed" in status and f"node(s) lost: mnode{node}" in status, status
    finally:
        bring_back(node)
    hpcr1(env, "resume", str(run), "--cluster", "local-multinode")
    wait_for(lambda: ended(run, 2), "the resumed stage", explain=lambda: job_story(env, run, "stage1_sft"))
    entry = manifest(run)["stage1_sft"]
    assert entry["state"] == "done" and entry["attempts"] == 2, job_story(env, run, "stage1_sft")
    assert resumed_from(run) and resumed_from(run)[0] >= 25
    same_weights(env, run, reference)


def test_a_preempted_two_node_stage_requeues_and_resumes(env, reference, tmp_path):
    run = submit(env, tmp_path, FAULTS)
    job = manifest(run)["stage1_sft"]["job_id"]
    wait_for(lambda: steps_done(run) >= FAULT_AT_STEP, "training to pass step 30", timeout=300)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=env, check=True)
    wait_for(
        lambda: ended(run, 2),
        "the requeued job to end",
        explain=lambda: job_story(env, run, "stage1_sft"),
    )
    entry = manifest(run)["stage1_sft"]
    assert entry["state"] == "done" and entry["preempted"] == 1, job_story(env, run, "stage1_sft")
    assert resumed_from(run) and resumed_from(run)[0] >= FAULT_AT_STEP
    same_weights(env, run, reference)
