"""Job state from Slurm: squeue for queued/running jobs, `sacct -c` (the job-completion log) for
finished ones. Missing tools or jobs give no entry, never an error: status must always print."""

from __future__ import annotations

import os
import shutil
import subprocess


def slurm_env(slurm_conf: str | None) -> dict[str, str] | None:
    """The environment for a Slurm client of a cluster whose config is `slurm_conf` (a profile's);
    None (inherit ours) where the profile names none. Jobs submitted with it inherit it too."""
    return None if not slurm_conf else {**os.environ, "SLURM_CONF": slurm_conf}


def recorded_conf(stages: dict) -> str | None:
    """The Slurm config a run's jobs were submitted with (`hpcr1 submit` records the profile's in
    each stage's manifest entry), for the later squeue, sacct and scancel of the same jobs."""
    return next((e["slurm_conf"] for e in stages.values() if e.get("slurm_conf")), None)


# Slurm states of a job that ended without success: its afterok dependants never start.
ENDED_BADLY = ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def _query(cmd: list[str], slurm_conf: str | None = None) -> list[list[str]]:
    if shutil.which(cmd[0]) is None:
        return []
    out = subprocess.run(cmd, capture_output=True, text=True, env=slurm_env(slurm_conf))
    return (
        [line.split("|") for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []
    )


def job_states(job_ids: list[str], slurm_conf: str | None = None) -> dict[str, tuple[str, str]]:
    """{job id: (state, elapsed)} for the jobs Slurm still knows; a pending job's state says why it
    waits, e.g. "PENDING (BeginTime)" for a requeued job in Slurm's hold before it may start again.
    `slurm_conf`: the cluster's config, where its profile names one."""
    if not job_ids:
        return {}
    ids = ",".join(job_ids)
    states = {
        row[0]: (f"{row[1]} ({row[3]})" if row[1] == "PENDING" else row[1], row[2])
        for row in _query(["squeue", "-h", "-j", ids, "-o", "%i|%T|%M|%r"], slurm_conf)
        if len(row) == 4
    }
    finished = [j for j in job_ids if j not in states]
    if finished:
        for row in _query(
            ["sacct", "-c", "-n", "-P", "-j", ",".join(finished), "-o", "JobID,State,Elapsed"], slurm_conf
        ):
            if len(row) == 3 and row[0] in finished:
                states[row[0]] = (row[1], row[2])  # the last record wins: a requeued job has several
    return states
