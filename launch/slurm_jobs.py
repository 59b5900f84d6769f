"""Job state from Slurm: squeue for queued/running jobs, `sacct -c` (the job-completion log) for
finished ones, scontrol and sinfo for a running job's nodes. Missing tools or jobs give no entry,
never an error: status must always print."""

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


def job_fields(job_id: str, slurm_conf: str | None = None) -> dict[str, str]:
    """`scontrol -o show job`'s Key=Value fields of a job Slurm still knows; {} otherwise. A value
    with spaces (Command's arguments, a Reason) is cut at the first: none read here has one."""
    rows = _query(["scontrol", "-o", "show", "job", job_id], slurm_conf)
    line = "|".join(rows[0]) if rows else ""
    return dict(part.split("=", 1) for part in line.split() if "=" in part)


def hostnames(nodelist: str, slurm_conf: str | None = None) -> list[str]:
    return [row[0] for row in _query(["scontrol", "show", "hostnames", nodelist], slurm_conf)]


def lost_batch_host(job_id: str, slurm_conf: str | None = None) -> dict[str, str]:
    """{batch host: why it is lost} for a RUNNING job whose batch host, the node running its batch
    script (the stage driver), Slurm set DOWN or removed from the job; {} otherwise. With --no-kill
    (launch.sbatch) Slurm keeps such a job running on its other nodes until its time limit, and no
    driver is left to record the failure. A node only not responding ("*") may answer again: it
    counts once Slurm gives up on it (SlurmdTimeout) and sets it DOWN."""
    job = job_fields(job_id, slurm_conf)
    host, nodes = job.get("BatchHost"), job.get("NodeList", "")
    if job.get("JobState") != "RUNNING" or not host:
        return {}
    members = hostnames(nodes, slurm_conf)
    if not members:
        return {}  # scontrol cannot tell: no ground to fail a running job on
    state = node_state(host, slurm_conf)
    if host not in members:
        # It may be up again by now: Slurm dropped it from the job when it set it DOWN.
        return {host: f"{state}, no longer among the job's nodes {nodes}"}
    return {host: state} if base_state(state) == "down" else {}


def base_state(state: str) -> str:
    """A node's sinfo state (%T) without its flags, lower case: "down*" (not responding) gives
    "down", and anything joined after a "+" is dropped."""
    return state.rstrip("*").split("+")[0].lower()


def node_state(node: str, slurm_conf: str | None = None) -> str:
    """sinfo's state of the node (e.g. "down*"), or "unknown to sinfo"."""
    rows = _query(["sinfo", "-h", "-N", "-n", node, "-o", "%T"], slurm_conf)
    return rows[0][0] if rows else "unknown to sinfo"
