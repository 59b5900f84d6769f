"""Loaded by every verl process on every platform, Ray's workers included (VERL_USE_EXTERNAL_MODULES,
stages/engines/verl_trainer.py:verl_process_env): verl 0.9.1's bugs on the paths the project runs,
each fixed where its module is imported."""

from __future__ import annotations

import logging
from types import ModuleType

from stages.engines.verl_import_hooks import after_import


class _NoFlush(logging.LoggerAdapter):
    """A logger that takes print()'s `flush`, which logging refuses with a TypeError."""

    def log(self, level, msg, *args, **kwargs):
        kwargs.pop("flush", None)
        super().log(level, msg, *args, **kwargs)


def _log_without_flush(module: ModuleType) -> None:
    # trainer_separate_async.py:181-185 logs with flush=True where hybrid_engine is false (a rollout
    # pool of its own, nothing colocated): every such run would fail in the trainer's setup.
    module.logger = _NoFlush(module.logger, {})


after_import("verl.trainer.ppo.v1.trainer_separate_async", _log_without_flush)
