"""Stages in a container on the local single-node Slurm: a profile naming podman and an image built
here from a Debian root file system (tests/support/podman_image.sh, nothing pulled), with the
project, the run directory and the venv's Python mounted. `hpcr1 doctor`'s probe and a stage's ranks
run inside it; the batch script and the stage driver stay on the node, where srun is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, SMALL_RUN
from tests.slurm.test_slurm_pipeline import hpcr1, job_story, manifest, submit, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
IMAGE = "localhost/hpcr1-ranks:test"


@pytest.fixture(scope="module")
def podman_profile(tmp_path_factory) -> Path:
    """The `local` profile with its steps in podman. The OCI runtime is runc without resource limits
    or a cgroup mount (tests/support/runc-without-limits says why); the venv's Python is mounted
    unless it is the image's own (/usr)."""
    out = subprocess.run([str(REPO / "tests/support/podman_image.sh"), IMAGE], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    profile = yaml.safe_load((REPO / "slurm/profiles/local.yaml").read_text())
    profile["name"] = "local-podman"
    profile["container"] = {
        "runtime": "podman",
        "image": IMAGE,
        "mounts": [] if sys.base_prefix == "/usr" else [sys.base_prefix],
        "options": [f"--runtime={REPO / 'tests/support/runc-without-limits'}"],
    }
    path = tmp_path_factory.mktemp("profile") / "local-podman.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path


def test_the_doctors_probe_runs_in_the_profiles_container_and_passes(slurm_env, podman_profile, tmp_path):
    assert not Path("/run/.containerenv").exists(), "the tests' host must not itself be a podman container"
    config = str(REPO / "configs" / "tiny-cpu.yaml")
    out = hpcr1(
        slurm_env, "doctor", config, "--cluster", str(podman_profile), "--run-dir", str(tmp_path / "run")
    )
    lines = out.stdout.splitlines()
    assert lines[0] == "probing 1 node(s) of local-podman (one short job)...", out.stdout
    verdicts = [line.split()[0] for line in lines[1:-1]]
    assert verdicts and set(verdicts) == {"PASS"}, out.stdout
    assert any(line.endswith(f": podman, image {IMAGE}") for line in lines if "container on" in line), (
        out.stdout
    )
    [node] = (tmp_path / "run" / "doctor").glob("node-*.json")
    facts = json.loads(node.read_text())
    assert facts["container"] == "podman" and facts["executable"] == sys.executable
    assert facts["nvidia_smi"] is None and facts["torch_cuda"] is None and "torch" in facts["packages"]
    assert not list((tmp_path / "run").glob("stage*")), "the doctor runs no stage"


def test_a_stages_ranks_run_in_the_profiles_container_and_take_the_requeues_usr1_there(
    slurm_env, podman_profile, tmp_path
):
    """USR1 to the batch script, as Slurm sends before the time limit, reaches the ranks through srun
    and podman's signal proxy: they checkpoint, the job requeues, and the second attempt resumes in
    the container too."""
    stage = {**SMALL_RUN["stage1_sft"], "steps": 40, "checkpoint_every": 5}
    run = submit(slurm_env, tmp_path, {**SMALL_RUN, "name": "podman", "stage1_sft": stage}, "--only",
                 "stage1_sft", cluster=str(podman_profile))  # fmt: skip
    story = lambda: job_story(slurm_env, run, "stage1_sft")  # noqa: E731
    wait_for(lambda: list((run / "stage1_sft" / "ckpt").glob("step-*")), "a checkpoint", explain=story)
    job = manifest(run)["stage1_sft"]["job_id"]
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm_env, check=True)
    wait_for(lambda: manifest(run)["stage1_sft"]["state"] in ("done", "failed"), "the stage", explain=story)
    entry = manifest(run)["stage1_sft"]
    assert (entry["state"], entry["attempts"]) == ("done", 2), story()
    assert "stage1_sft: resuming from step" in "".join(
        p.read_text() for p in (run / "stage1_sft" / "logs").glob("slurm-*.out")
    )
    logs = run / "stage1_sft" / "logs"
    starts = [line for log in sorted(logs.glob("rank-*.log")) for line in log.read_text().splitlines()
              if " of 2 on cpu " in line]  # fmt: skip
    assert len(starts) == 4 and all(line.endswith(", container podman") for line in starts), starts
    assert (
        json.loads((run / "stage1_sft" / "eval.json").read_text())["n"] == SMALL_RUN["eval"]["num_examples"]
    )
