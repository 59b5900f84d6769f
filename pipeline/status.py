"""`hpcr1 status`: one line per stage from the manifest, the stage's metrics and Slurm."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from core.manifest import Manifest
from core.rundir import RunDir
from launch.slurm_jobs import ENDED_BADLY, job_states, lost_batch_host, recorded_conf, slurm_env
from runtime.rank_failure import lost_nodes_summary


def last_step(metrics: Path) -> int | None:
    if not metrics.exists():
        return None
    lines = metrics.read_text().splitlines()
    return json.loads(lines[-1])["step"] if lines else None


def stage_rows(run_dir: Path) -> list[str]:
    run, manifest = RunDir(run_dir), Manifest(run_dir)
    stages = manifest.data["stages"]
    slurm = job_states([e["job_id"] for e in stages.values() if e.get("job_id")], recorded_conf(stages))
    rows = [
        f"{'stage':<14} {'state':<8} {'attempts':>8} {'last step':>9} {'accuracy':>8}  {'job':<8} "
        f"{'slurm state':<22} {'elapsed':>9}"
    ]
    for sid, entry in stages.items():
        accuracy = entry.get("eval", {}).get("accuracy")
        step = last_step(run.metrics(sid))
        job = entry.get("job_id") or "-"
        state, elapsed = slurm.get(job, ("-", "-"))
        rows.append(
            f"{sid:<14} {entry['state']:<8} {entry['attempts']:>8} {'-' if step is None else step:>9} "
            f"{'-' if accuracy is None else f'{accuracy:.3f}':>8}  {job:<8} {state:<22} {elapsed:>9}"
        )
    failed = [(sid, e["error"]) for sid, e in stages.items() if e["state"] == "failed" and e.get("error")]
    return (
        rows + [f"{sid}: {_summary(error)}" for sid, error in failed] + never_running(run_dir, stages, slurm)
    )


def fail_orphaned_stages(run_dir: Path, echo=print) -> list[str]:
    """Fail each unfinished stage whose driver, which would record its outcome, is gone: its job
    ended without one (`job_end_error`: e.g. it ran into its time limit), or it is still running
    but lost its batch host (launch.slurm_jobs.lost_batch_host) and would hold its surviving nodes
    and its dependants until the time limit: that job is cancelled. Returns the stages failed."""
    manifest = Manifest(run_dir)
    stages = manifest.data["stages"]
    conf = recorded_conf(stages)
    # pending or running: a job of its own in Slurm that may have ended or been orphaned
    unfinished = {
        sid: e for sid, e in stages.items() if e["state"] in ("pending", "running") and e.get("job_id")
    }
    slurm = job_states([e["job_id"] for e in unfinished.values()], conf)
    failed = []
    for sid, entry in unfinished.items():
        job = entry["job_id"]
        error = job_end_error(run_dir, entry, *slurm.get(job, (None, None)))
        if error is None:
            lost = lost_batch_host(job, conf)
            error = orphan_error(job, lost, conf) if lost else None
        if error:
            manifest.fail(sid, error)
            echo(f"{sid}: failed: {manifest.stage(sid)['error']['summary']}")
            failed.append(sid)
    return failed


def job_end_error(run_dir: Path, entry: dict, state: str | None, elapsed: str | None) -> dict | None:
    """The error of a stage whose job Slurm says ended badly (`state`) while the manifest still says
    running, so that its driver ended with it; or that ran into its time limit (TIMEOUT), whatever
    the manifest says: a stage job requeues itself when the stage stops on USR1, never once it is
    out of time. (A pending stage's CANCELLED job was a dependant of a failed one: never_running.)"""
    ended_running = entry["state"] == "running" and state is not None and state.startswith(ENDED_BADLY)
    if not (state == "TIMEOUT" or ended_running):
        return None
    job, resume = entry["job_id"], f"`hpcr1 resume {run_dir} --cluster {entry.get('cluster', 'NAME')}`"
    if state == "TIMEOUT":
        summary = (
            f"ran into its time limit: job {job} ended TIMEOUT after {elapsed}, before the stage stopped "
            f"for a requeue, and Slurm does not requeue it; {resume} continues it from its last checkpoint"
        )
    else:
        summary = f"job {job} ended {state} after {elapsed}, the stage unfinished; {resume} starts it again"
    return {"summary": summary, "slurm_state": state, "job_id": job, "exit_code": None, "rank": None}


def orphan_error(job: str, lost: dict[str, str], conf: str | None) -> dict:
    """Cancels the job (freeing its nodes; Slurm then ends its afterok dependants as for any failed
    job) and returns the stage's error, saying whether the cancel went through."""
    out = subprocess.run(["scancel", job], capture_output=True, text=True, env=slurm_env(conf))
    cancelled = "cancelled" if out.returncode == 0 else f"scancel failed: {out.stderr.strip()}"
    summary = (
        f"{lost_nodes_summary(lost)}; it ran job {job}'s batch script (the stage driver); job {cancelled}"
    )
    return {"summary": summary, "lost_nodes": lost, "job_id": job, "exit_code": None, "rank": None}


def never_running(run_dir: Path, stages: dict, slurm: dict) -> list[str]:
    """A line for each queued stage that waits (afterok, through other queued stages) on one that
    failed: Slurm drops such a job (or holds it for DependencyNeverSatisfied), so it will not run."""
    lines = []
    for sid, entry in stages.items():
        root = failed_upstream(stages, slurm, sid)
        if root:
            lines.append(
                f"{sid}: will not run: it waits on {root}, which failed; "
                f"`hpcr1 resume {run_dir} --cluster {entry.get('cluster', 'NAME')}` resubmits from {root}"
            )
    return lines


def failed_upstream(stages: dict, slurm: dict, sid: str) -> str | None:
    """The failed stage that `sid`'s job waits on, if any; None when it may still run."""
    if stages[sid]["state"] != "pending" or not stages[sid].get("job_id"):
        return None
    up = stages[sid].get("after")
    while up in stages:
        if job_failed(stages[up], slurm):
            return up
        if stages[up]["state"] != "pending":
            return None
        up = stages[up].get("after")
    return None


def job_failed(entry: dict, slurm: dict) -> bool:
    """Whether the stage's last job ended without success: Slurm's word where it still knows the job
    (a resubmitted stage keeps "failed" in the manifest until its new job starts), else the manifest's."""
    state = slurm.get(entry.get("job_id") or "-", (None,))[0]
    if state is None:
        return entry["state"] == "failed"
    return state.startswith(ENDED_BADLY)


def _summary(error: dict | str) -> str:
    # Manifests written before errors were structured hold a plain string.
    return error if isinstance(error, str) else error["summary"]
