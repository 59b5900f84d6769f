"""Per-step metrics: one JSON line a step in <stage>/metrics.jsonl, mirrored to wandb (offline by
default). Only rank 0 writes. On resume, lines past the resumed step are dropped so that a step
never appears twice."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from runtime.phases import take_phase_times

log = logging.getLogger(__name__)


class MetricsLogger:
    def __init__(
        self,
        path: Path,
        enabled: bool,
        resume_step: int,
        wandb_mode: str,
        wandb_project: str,
        wandb_run: tuple[str, str],
        config: dict,
    ):
        self.path, self.enabled = path, enabled
        self._file = None
        self._wandb = None
        if not enabled:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(resume_step)
        self._file = open(path, "a", buffering=1)
        if wandb_mode != "disabled":
            import wandb

            self._wandb = wandb.init(
                project=wandb_project,
                name=wandb_run[0],
                dir=str(path.parent),
                mode=wandb_mode,
                config=config,
                resume="allow",
                id=wandb_run[1],
            )

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = [line for line in self._complete_lines() if json.loads(line)["step"] <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def _complete_lines(self) -> list[str]:
        """The file's lines, less a last one cut short (a kill or a full disk mid-write: it never
        ended in a newline). A damaged line anywhere else is an error naming it."""
        text = self.path.read_text()
        lines = text.split("\n")
        if lines[-1]:
            log.warning("%s: dropping its last line, cut short: %r", self.path, lines[-1][:80])
        for number, line in enumerate(lines[:-1], start=1):
            try:
                json.loads(line) if line else None
            except ValueError as e:
                raise ValueError(f"{self.path}, line {number}: not a JSON metrics line ({e})") from None
        return [line for line in lines[:-1] if line]

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def log_step(
        self, step: int, stats: dict, started_wall: float, elapsed: float, counts: dict[str, float]
    ) -> None:
        """A training step's line: its statistics, when it began (t_start, epoch seconds), its wall
        time, the wall time of each phase since the last step (every rank: it resets the phase
        clock) and `<unit>_per_s` for each unit the step processed (`counts`)."""
        phases = {f"phase_time/{name}": seconds for name, seconds in take_phase_times().items()}
        rates = {f"{unit}_per_s": n / elapsed for unit, n in counts.items()}
        self.log(step, {**stats, **phases, "t_start": started_wall, "step_time_s": elapsed, **rates})

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
