"""`hpcr1 status`: one line per stage from the manifest, the stage's metrics and Slurm."""

from __future__ import annotations

import json
from pathlib import Path

from core.manifest import Manifest
from core.rundir import RunDir
from launch.slurm_jobs import job_states


def last_step(metrics: Path) -> int | None:
    if not metrics.exists():
        return None
    lines = metrics.read_text().splitlines()
    return json.loads(lines[-1])["step"] if lines else None


def stage_rows(run_dir: Path) -> list[str]:
    run, manifest = RunDir(run_dir), Manifest(run_dir)
    stages = manifest.data["stages"]
    slurm = job_states([e["job_id"] for e in stages.values() if e.get("job_id")])
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
    return rows + [f"{sid}: {_summary(error)}" for sid, error in failed]


def _summary(error: dict | str) -> str:
    # Manifests written before errors were structured hold a plain string.
    return error if isinstance(error, str) else error["summary"]
