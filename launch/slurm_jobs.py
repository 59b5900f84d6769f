"""Job state from Slurm: squeue for queued/running jobs, `sacct -c` (the job-completion log) for
finished ones. Missing tools or jobs give no entry, never an error: status must always print."""

from __future__ import annotations

import shutil
import subprocess


def _query(cmd: list[str]) -> list[list[str]]:
    if shutil.which(cmd[0]) is None:
        return []
    out = subprocess.run(cmd, capture_output=True, text=True)
    return (
        [line.split("|") for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []
    )


def job_states(job_ids: list[str]) -> dict[str, tuple[str, str]]:
    """{job id: (state, elapsed)} for the jobs Slurm still knows; a pending job's state says why it
    waits, e.g. "PENDING (BeginTime)" for a requeued job in Slurm's hold before it may start again."""
    if not job_ids:
        return {}
    ids = ",".join(job_ids)
    states = {
        row[0]: (f"{row[1]} ({row[3]})" if row[1] == "PENDING" else row[1], row[2])
        for row in _query(["squeue", "-h", "-j", ids, "-o", "%i|%T|%M|%r"])
        if len(row) == 4
    }
    finished = [j for j in job_ids if j not in states]
    if finished:
        for row in _query(["sacct", "-c", "-n", "-P", "-j", ",".join(finished), "-o", "JobID,State,Elapsed"]):
            if len(row) == 3 and row[0] in finished:
                states[row[0]] = (row[1], row[2])  # the last record wins: a requeued job has several
    return states
