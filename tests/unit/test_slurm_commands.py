"""The Slurm commands as a user meets them, against fake Slurm clients on PATH that record what they
were called with: the profile's SLURM_CONF reaches sbatch, squeue, sacct and scancel; `submit` takes
--only and --from, and calls an unknown option one; `status` says when a queued stage waits on one
that failed, and `resume --cluster` resubmits from the failed one.

Fakes, not a Slurm: a unit test starts no service, and a real one shows a lost batch host, a node not
answering yet or a TIMEOUT only after minutes. The real clients run in tests/slurm: submit, status,
cancel, resume and a failed stage's dependants in test_slurm_pipeline.py, the profile's SLURM_CONF
alone (no SLURM_CONF in the environment) in test_multinode_verl.py, lost nodes failing the stage in
test_multinode_faults.py."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from pipeline.cli import main
from tests.conftest import REPO, SMALL_RUN

TWO_STAGES = {**SMALL_RUN, "stage3_sft": {**SMALL_RUN["stage1_sft"], "init_from": "stage1_sft"}}
LOCAL_CONF = "/var/tmp/hpcr1-slurm/etc/slurm.conf"
# Each fake client logs "name SLURM_CONF args..." and prints what the test put in <name>.out
# (scontrol: in scontrol-job-ID.out or scontrol-hostnames-LIST.out).
FAKE = """#!/bin/bash
echo "$(basename "$0") ${SLURM_CONF:-unset} $*" >> "$FAKE_SLURM/calls"
if [ "$(basename "$0")" = sbatch ]; then
  n=$(( $(cat "$FAKE_SLURM/next" 2>/dev/null || echo 100) + 1 )); echo "$n" > "$FAKE_SLURM/next"; echo "$n"
elif [ "$(basename "$0")" = scontrol ]; then
  cat "$FAKE_SLURM/scontrol-${*: -2:1}-${*: -1}.out" 2>/dev/null || true  # show job ID, show hostnames LIST
else
  cat "$FAKE_SLURM/$(basename "$0").out" 2>/dev/null || true
fi
"""


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch, capsys):
    """The fake clients' directory, and `hpcr1(*args)`: the command line run in this process (no
    second interpreter to import torch), with the fakes first on PATH and no SLURM_CONF exported."""
    bin_dir = tmp_path / "fake-slurm"
    bin_dir.mkdir()
    for name in ("sbatch", "squeue", "sacct", "scancel", "scontrol", "sinfo"):
        (bin_dir / name).write_text(FAKE)
        (bin_dir / name).chmod(0o755)
    monkeypatch.delenv("SLURM_CONF", raising=False)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM", str(bin_dir))
    monkeypatch.chdir(REPO)

    def hpcr1(*args: str) -> Result:
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's errors
            code = e.code
        out = capsys.readouterr()
        return Result(code, out.out, out.err)

    return bin_dir, hpcr1


def calls(bin_dir: Path, name: str) -> list[list[str]]:
    lines = (bin_dir / "calls").read_text().splitlines() if (bin_dir / "calls").exists() else []
    return [line.split()[1:] for line in lines if line.split()[0] == name]


def submitted(bin_dir: Path) -> list[str]:
    return [arg.split("=", 1)[1] for call in calls(bin_dir, "sbatch") for arg in call if "--job-name" in arg]


def submit(hpcr1, tmp_path, *extra) -> Result:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(TWO_STAGES))
    return hpcr1("submit", str(path), "--cluster", "local", "--run-dir", str(tmp_path / "run"), *extra)


def test_the_profiles_slurm_conf_reaches_every_slurm_call(fake_slurm, tmp_path):
    bin_dir, hpcr1 = fake_slurm
    out = submit(hpcr1, tmp_path)
    assert out.returncode == 0, out.stderr
    assert [call[0] for call in calls(bin_dir, "sbatch")] == [LOCAL_CONF, LOCAL_CONF]
    hpcr1("status", str(tmp_path / "run"))
    hpcr1("cancel", str(tmp_path / "run"))
    names = ("squeue", "sacct", "scancel", "scontrol")
    assert {call[0] for name in names for call in calls(bin_dir, name)} == {LOCAL_CONF}


def test_submit_takes_only_and_from(fake_slurm, tmp_path):
    bin_dir, hpcr1 = fake_slurm
    out = submit(hpcr1, tmp_path, "--only", "stage1_sft")
    assert out.returncode == 0, out.stderr
    assert submitted(bin_dir) == ["hpcr1-stage1_sft"]
    out = submit(hpcr1, tmp_path, "--from", "stage3_sft")
    assert out.returncode == 0, out.stderr
    assert submitted(bin_dir) == ["hpcr1-stage1_sft", "hpcr1-stage3_sft"]


def test_an_unknown_option_is_called_one(fake_slurm, tmp_path):
    _, hpcr1 = fake_slurm
    out = submit(hpcr1, tmp_path, "--bogus", "x")
    assert out.returncode == 2
    assert "unrecognized arguments: --bogus" in out.stderr and "override" not in out.stderr


def test_status_says_a_dependant_of_a_failed_stage_will_not_run_and_resume_resubmits(fake_slurm, tmp_path):
    bin_dir, hpcr1 = fake_slurm
    assert submit(hpcr1, tmp_path).returncode == 0
    run = tmp_path / "run"
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["stages"]["stage1_sft"].update(state="failed", error={"summary": "rank 0 failed"})
    (run / "manifest.json").write_text(json.dumps(manifest))
    first, second = (manifest["stages"][s]["job_id"] for s in ("stage1_sft", "stage3_sft"))
    # Slurm has dropped the dependant (kill_invalid_depend): the completion log says CANCELLED.
    (bin_dir / "sacct.out").write_text(f"{first}|FAILED|00:00:09\n{second}|CANCELLED by 0|00:00:00\n")
    status = hpcr1("status", str(run)).stdout
    assert f"stage3_sft: will not run: it waits on stage1_sft, which failed; `hpcr1 resume {run}" in status

    out = hpcr1("resume", str(run), "--cluster", "local")
    assert out.returncode == 0, out.stderr
    assert submitted(bin_dir)[2:] == ["hpcr1-stage1_sft", "hpcr1-stage3_sft"]
    resubmitted = json.loads((run / "manifest.json").read_text())["stages"]["stage1_sft"]["job_id"]
    assert f"--dependency=afterok:{resubmitted}" in calls(bin_dir, "sbatch")[-1]
    # The new jobs are queued: stage 1's "failed" from its last attempt no longer dooms stage 3.
    (bin_dir / "squeue.out").write_text(f"{resubmitted}|PENDING|0:00|None\n")
    assert "will not run" not in hpcr1("status", str(run)).stdout


def orphan(bin_dir: Path, job: str, nodes: str, batch_host_state: str) -> None:
    """Slurm's view of a RUNNING 2-node job whose batch host is mnode1, its nodes now `nodes`."""
    (bin_dir / f"scontrol-job-{job}.out").write_text(
        f"JobId={job} JobName=hpcr1-stage1_sft UserId=root(0) JobState=RUNNING Reason=None "
        f"NumNodes=2 NodeList={nodes} BatchHost=mnode1 Command=/x/stage1_sft.sbatch\n"
    )
    (bin_dir / f"scontrol-hostnames-{nodes}.out").write_text(nodes.replace(",", "\n") + "\n")
    (bin_dir / "sinfo.out").write_text(f"{batch_host_state}\n")


def running(run: Path, stage: str = "stage1_sft") -> str:
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["stages"][stage]["state"] = "running"
    (run / "manifest.json").write_text(json.dumps(manifest))
    return manifest["stages"][stage]["job_id"]


@pytest.mark.parametrize(
    "nodes, state, why",
    [
        ("mnode2", "idle", "idle, no longer among the job's nodes mnode2"),  # dropped by Slurm, back up since
        ("mnode1,mnode2", "down*", "down*"),
    ],
)
def test_status_fails_a_stage_whose_batch_host_was_lost_and_cancels_its_job(
    fake_slurm, tmp_path, nodes, state, why
):
    bin_dir, hpcr1 = fake_slurm
    assert submit(hpcr1, tmp_path).returncode == 0
    run = tmp_path / "run"
    job = running(run)
    orphan(bin_dir, job, nodes, state)
    status = hpcr1("status", str(run)).stdout
    assert f"node(s) lost: mnode1 ({why}); it ran job {job}'s batch script" in status, status
    entry = json.loads((run / "manifest.json").read_text())["stages"]["stage1_sft"]
    assert entry["state"] == "failed" and entry["error"]["lost_nodes"] == {"mnode1": why}, entry
    assert [call[1:] for call in calls(bin_dir, "scancel")] == [[job]]


def test_status_leaves_a_job_whose_batch_host_only_stopped_answering(fake_slurm, tmp_path):
    bin_dir, hpcr1 = fake_slurm
    assert submit(hpcr1, tmp_path).returncode == 0
    run = tmp_path / "run"
    orphan(bin_dir, running(run), "mnode1,mnode2", "mixed*")  # may answer again before SlurmdTimeout
    assert "lost" not in hpcr1("status", str(run)).stdout
    assert json.loads((run / "manifest.json").read_text())["stages"]["stage1_sft"]["state"] == "running"
    assert not calls(bin_dir, "scancel")


def test_status_fails_a_stage_whose_job_ran_into_its_time_limit(fake_slurm, tmp_path):
    bin_dir, hpcr1 = fake_slurm
    assert submit(hpcr1, tmp_path).returncode == 0
    run = tmp_path / "run"
    job = running(run)
    # The job is gone from the queue; the completion log has its end (a requeued job: the last record).
    (bin_dir / "sacct.out").write_text(f"{job}|REQUEUED|00:58:00\n{job}|TIMEOUT|01:00:02\n")
    status = hpcr1("status", str(run)).stdout
    row = next(line for line in status.splitlines() if line.startswith("stage1_sft "))
    assert row.split()[1] == "failed" and "TIMEOUT" in row, status
    assert (
        f"stage1_sft: ran into its time limit: job {job} ended TIMEOUT after 01:00:02, before the stage "
        f"stopped for a requeue, and Slurm does not requeue it; `hpcr1 resume {run} --cluster local`"
    ) in status, status
    entry = json.loads((run / "manifest.json").read_text())["stages"]["stage1_sft"]
    assert (entry["state"], entry["error"]["slurm_state"]) == ("failed", "TIMEOUT"), entry
    assert not calls(bin_dir, "scancel"), "an ended job is not cancelled"
    # Its dependant, queued behind it, will not run; resuming resubmits from the timed-out stage.
    assert "stage3_sft: will not run: it waits on stage1_sft, which failed" in status, status
