"""Checkpoint-and-requeue on a signal. Slurm sends USR1 (`--signal=B:USR1@s`, forwarded by the
stage driver to every rank) before a time limit; each rank only sets a flag, and the stages ask at
points every rank reaches (a training step's boundary, before and during export and evaluation,
after prompt selection, after synthesis's batches) whether any rank was signalled, so all ranks
stop at the same point, with what they did kept, and exit with PREEMPTED_EXIT."""

from __future__ import annotations

import logging
import os
import signal
from typing import NoReturn

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: "try again later" — the driver requeues instead of failing
_signalled = False


def _on_signal(signum, frame) -> None:
    global _signalled
    _signalled = True


def install_handlers() -> None:
    # Only USR1: a TERM (scancel, or preemption without grace) must end the job, not requeue it;
    # a requeued preempted job resumes from the newest periodic checkpoint instead.
    signal.signal(signal.SIGUSR1, _on_signal)


def signalled() -> bool:
    """Whether this rank was signalled: for work a rank does on its own between two collectives
    (a batch of answers), which it may leave early; all ranks then meet at `leave_if_requested`."""
    return _signalled


def stop_requested() -> bool:
    """True on every rank if any rank was signalled (a collective: call it on all ranks)."""
    # imported here: the stage driver reads PREEMPTED_EXIT and must not pay for importing torch
    import torch
    import torch.distributed as dist

    from runtime.dist import rank_device

    flag = torch.tensor([1 if _signalled else 0], device=rank_device())
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def leave_if_requested(log: logging.Logger, where: str) -> None:
    """If any rank was signalled (a collective: call it on all ranks), say where the stage stops and
    leave for the requeue; what was done before `where` must be kept by then."""
    if stop_requested():
        log.info("stopping %s on request; the next attempt continues from there", where)
        leave_for_requeue()


def leave_for_requeue() -> NoReturn:
    """Leave with PREEMPTED_EXIT, the checkpoint sealed on every rank. Under `srun --kill-on-bad-exit`
    the first rank out (75 is a bad exit to srun) gets the others a SIGTERM while they still tear
    down, and srun reports the highest code, 143: the driver would take a stage stopped for its
    requeue for a failed one. So the ranks leave right after shutdown's barrier, without the
    interpreter's finalisation (launch/worker.py), and a TERM before that means the step is over:
    the rank leaves with the same code, and srun reports 75."""
    signal.signal(signal.SIGTERM, _exit_preempted)
    raise SystemExit(PREEMPTED_EXIT)


def _exit_preempted(signum, frame) -> None:
    os._exit(PREEMPTED_EXIT)
