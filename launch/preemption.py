"""Checkpoint-and-requeue on a signal. Slurm sends USR1 (`--signal=B:USR1@s`, forwarded by the
stage driver to every rank) before a time limit; each rank only sets a flag, and the training loops ask at every step boundary whether any rank was signalled, so all
ranks stop after the same step, checkpoint together and exit with PREEMPTED_EXIT."""
from __future__ import annotations

import signal

import torch
import torch.distributed as dist

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: "try again later" — the driver requeues instead of failing
_signalled = False


def _on_signal(signum, frame) -> None:
    global _signalled
    _signalled = True


def install_handlers() -> None:
    # Only USR1: a TERM (scancel, or preemption without grace) must end the job, not requeue it;
    # a requeued preempted job resumes from the newest periodic checkpoint instead.
    signal.signal(signal.SIGUSR1, _on_signal)


def stop_requested() -> bool:
    """True on every rank if any rank was signalled (a collective: call it on all ranks)."""
    flag = torch.tensor([1 if _signalled else 0])
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
