"""manifest.json: per-stage state of a run, rewritten atomically after every change."""

from __future__ import annotations

import json
import time
from pathlib import Path

from core.atomic import atomic_write_text

STATES = ("pending", "running", "done", "failed")


class Manifest:
    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "manifest.json"
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {"stages": {}}

    def stage(self, stage_id: str) -> dict:
        return self.data["stages"].setdefault(stage_id, {"state": "pending", "attempts": 0})

    def update(self, stage_id: str, **fields) -> None:
        if "state" in fields and fields["state"] not in STATES:
            raise ValueError(f"unknown stage state {fields['state']!r}")
        self.stage(stage_id).update(fields)
        self.save()

    def start_attempt(self, stage_id: str) -> None:
        entry = self.stage(stage_id)
        self.update(
            stage_id, state="running", attempts=entry["attempts"] + 1, started=_now(), ended=None, error=None
        )

    def finish(self, stage_id: str, **fields) -> None:
        self.update(stage_id, state="done", ended=_now(), **fields)

    def fail(self, stage_id: str, error: dict) -> None:
        """`error["summary"]` is one line for `hpcr1 status`; the other fields are structured detail."""
        self.update(stage_id, state="failed", ended=_now(), error=error)

    def save(self) -> None:
        atomic_write_text(self.path, json.dumps(self.data, indent=2, sort_keys=True) + "\n")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def describe_eval(evaluation: dict) -> str:
    """A training stage's eval entry (eval.json) in one line: held-out greedy accuracy and mean@k,
    then the validation set's; `held-out 0.470 greedy, 0.431 mean@4 (n=200); validation ...`."""
    line = f"held-out {_accuracies(evaluation)}"
    if "validation" in evaluation:
        line += f"; validation {_accuracies(evaluation['validation'])}"
    return line


def _accuracies(result: dict) -> str:
    text = f"{result['accuracy']:.3f} greedy"
    if "mean_at_k" in result:
        text += f", {result['mean_at_k']:.3f} mean@{result['k']}"
    return f"{text} (n={result['n']})"
