"""What a stage's rank is handed: the resolved config, the run directory, its rank, its terminal."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import TextIO

from tqdm import tqdm

from core.config import RunConfig
from core.rundir import RunDir
from runtime.comm_profiler import CommProfiler
from runtime.dist import RankInfo
from runtime.rank_failure import fail_if_asked


@dataclass
class StageContext:
    cfg: RunConfig
    run: RunDir
    stage_id: str
    rank: RankInfo
    terminal: TextIO = field(default_factory=lambda: sys.stderr)
    profiler: CommProfiler | None = None

    def begin_step(self, step: int) -> None:
        """Tag what follows (communication events) with the step about to run; fail here if a test
        asked this rank to (runtime.rank_failure.FAIL_AT_ENV)."""
        fail_if_asked(self.rank.rank, step)
        if self.profiler is not None:
            self.profiler.set_step(step)

    @property
    def stage(self):
        return getattr(self.cfg, self.stage_id)

    @property
    def log(self) -> logging.Logger:
        return logging.getLogger(f"hpcr1.{self.stage_id}")

    @property
    def is_main(self) -> bool:
        return self.rank.rank == 0

    def progress(self, total: int, initial: int = 0, unit: str = "step") -> tqdm:
        """Rank 0's progress bar (steps, ETA, postfix for loss); a silent one elsewhere."""
        return tqdm(
            total=total,
            initial=initial,
            unit=unit,
            desc=self.stage_id,
            file=self.terminal,
            disable=not self.is_main,
            dynamic_ncols=True,
            mininterval=0.5 if self.terminal.isatty() else 10.0,
        )
