"""Imported by the forkserver that forks a node's ranks, before the first fork (launch/torchrun.py):
imports the modules named in HPCR1_PRELOAD, with what they print while importing (megatron-core's
and DeepSpeed's notices) written to HPCR1_PRELOAD_LOG, not to the terminal the ranks share with
`hpcr1 run`. A module that fails to import here is imported again by each rank, which reports it."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

PRELOAD_ENV = "HPCR1_PRELOAD"
PRELOAD_LOG_ENV = "HPCR1_PRELOAD_LOG"


def import_quietly(modules: list[str], log_path: str) -> None:
    terminal = os.dup(1), os.dup(2)
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            for module in modules:
                importlib.import_module(module)
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            for fd, saved in zip((1, 2), terminal):
                os.dup2(saved, fd)
                os.close(saved)


if PRELOAD_ENV in os.environ:  # in the forkserver; elsewhere this module only names the variables
    import_quietly(os.environ[PRELOAD_ENV].split(","), os.environ[PRELOAD_LOG_ENV])
