"""torchrun, recording how each failed rank ended: `python -m launch.torchrun FAILURES_JSON ARGS...`
runs `torchrun ARGS...` and, if ranks fail, writes to FAILURES_JSON each failed rank's exit code,
signal and torchrun's timestamp (whole seconds), in the order torchrun saw them end. A rank killed
by a signal leaves no record of its own: this is where the driver learns which rank it was and how
it ended (runtime.rank_failure).

Ranks of `-m launch.worker RUN_DIR STAGE_ID` are forked from one process that has imported the
stage's modules (torchrun's function entry point with the forkserver start method): a node's ranks
pay for torch, megatron-core, DeepSpeed and transformers once, not once each (seconds of CPU per
rank). Where torch is built for a GPU nothing is preloaded: a fork after CUDA's driver has started
(DeepSpeed asks for devices at import) leaves the child unable to use it.

It also carries preemption through torchrun, which on its own would die of a USR1 (the default
action) and report ranks that stopped to be requeued as failed: USR1 is passed on to the ranks,
and when ranks stopped with PREEMPTED_EXIT (their checkpoint sealed behind a barrier) and the rest
only by torchrun's SIGTERM that followed, this process exits with PREEMPTED_EXIT too.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
from pathlib import Path

import psutil
import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, parse_args, run

from core.atomic import atomic_write_text
from core.rundir import RunDir
from launch.preload import PRELOAD_ENV, PRELOAD_LOG_ENV
from runtime.preemption import PREEMPTED_EXIT

RANK_MODULE = "launch.worker"
# What importing the stage's modules printed, in the stage's logs/.
PRELOAD_LOG = "preload.log"


def _ranks():
    """The rank processes: torchrun's children, or the forkserver's (launch.worker.run_forked_rank
    passes a signal on to the rank it forked), never multiprocessing's own helpers (a USR1 would
    kill them)."""
    for child in psutil.Process().children():
        try:
            command = " ".join(child.cmdline())
            if "multiprocessing.forkserver" in command:
                yield from child.children()
            elif "multiprocessing." not in command:
                yield child
        except psutil.NoSuchProcess:  # ended meanwhile
            pass


def _forward_to_ranks(signum, frame) -> None:
    for rank in _ranks():
        try:
            rank.send_signal(signum)
        except psutil.NoSuchProcess:
            pass


def preempted(failures) -> bool:
    codes = {f.exitcode for f in failures}
    return PREEMPTED_EXIT in codes and codes <= {PREEMPTED_EXIT, -signal.SIGTERM}


def preload_modules(run_dir: str, stage_id: str) -> list[str]:
    """What every rank of the stage imports before its first step; nothing where torch has a GPU
    backend (module docstring)."""
    if torch.version.cuda or torch.version.hip:
        return []
    from core.config import load_resolved
    from stages.kinds import STAGE_MODULES

    stage = getattr(load_resolved(RunDir(Path(run_dir))), stage_id)
    return [RANK_MODULE, STAGE_MODULES[type(stage)]]


def launch(torchrun_args: list[str]) -> None:
    args = parse_args(torchrun_args)
    if not (args.module and args.training_script == RANK_MODULE):
        run(args)  # any other program: torchrun as it is
        return
    from launch.worker import run_forked_rank

    run_dir, stage_id = args.training_script_args
    modules = preload_modules(run_dir, stage_id)
    if modules:
        # Read by launch.preload in the forkserver, which inherits this environment.
        os.environ[PRELOAD_ENV] = ",".join(modules)
        os.environ[PRELOAD_LOG_ENV] = str(RunDir(Path(run_dir)).logs(stage_id) / PRELOAD_LOG)
        multiprocessing.set_forkserver_preload(["launch.preload"])
    args.start_method = "forkserver"
    config, _, _ = config_from_args(args)
    elastic_launch(config=config, entrypoint=run_forked_rank)(run_dir, stage_id)


def main(argv: list[str]) -> None:
    failures_file, *torchrun_args = argv
    signal.signal(signal.SIGUSR1, _forward_to_ranks)
    try:
        launch(torchrun_args)
    except ChildFailedError as e:
        if preempted(e.failures.values()):
            sys.exit(PREEMPTED_EXIT)
        # Insertion order is the order torchrun's monitor saw the ranks end (a poll every 0.1 s).
        ended = [
            {
                "rank": rank,
                "exitcode": f.exitcode,
                "signal": None if f.exitcode >= 0 else f.signal_name(),
                "timestamp": f.timestamp,
            }
            for rank, f in e.failures.items()
        ]
        atomic_write_text(failures_file, json.dumps(ended, indent=2) + "\n")
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
