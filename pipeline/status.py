"""`hpcr1 status`: one line per stage from the manifest and the stage's metrics."""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.manifest import Manifest
from pipeline.rundir import RunDir


def last_step(metrics: Path) -> int | None:
    if not metrics.exists():
        return None
    lines = metrics.read_text().splitlines()
    return json.loads(lines[-1])["step"] if lines else None


def stage_rows(run_dir: Path) -> list[str]:
    run, manifest = RunDir(run_dir), Manifest(run_dir)
    rows = [f"{'stage':<14} {'state':<8} {'attempts':>8} {'last step':>9}  {'accuracy':>8}  ended"]
    for sid, entry in manifest.data["stages"].items():
        accuracy = entry.get("eval", {}).get("accuracy")
        step = last_step(run.metrics(sid))
        rows.append(f"{sid:<14} {entry['state']:<8} {entry['attempts']:>8} {step if step is not None else '-':>9}  "
                    f"{accuracy if accuracy is not None else '-':>8}  {entry.get('ended') or '-'}")
    return rows
