"""The parts of runtime.dist that a process outside any process group calls too, importable without
torch: the stage driver surveys checkpoints (stages/checkpoint.py) and picks rendezvous ports, and
importing torch would cost every `hpcr1` process seconds of CPU for nothing.

In a process group they act as collectives; a process that never imported torch.distributed has
not joined one, so none of them imports it.
"""

from __future__ import annotations

import socket
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist


def joined_group():
    """torch.distributed where this process has joined a process group, else None."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_initialized() else None


def free_port() -> int:
    """A TCP port free on this host now (the OS's pick), for a rendezvous to listen on."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def claimed(items: list, key: str, store: dist.Store | None = None):
    """`items` handed out once each over all ranks, first come first served, through the process
    group's store (`key` names this one hand-out): a rank that is done early takes the next item
    instead of waiting for the others, so none finishes more than one item after another."""
    dist = joined_group()
    if store is None and dist is None:
        yield from items
        return
    store = store or dist.distributed_c10d._get_default_store()
    while (i := store.add(key, 1) - 1) < len(items):
        yield items[i]


def from_rank0(compute):
    """Rank 0's `compute()`, on every rank (a collective): one decision, or one view of a shared
    file system, where each rank's own might differ."""
    dist = joined_group()
    value = [compute() if dist is None or dist.get_rank() == 0 else None]
    if dist is not None:
        dist.broadcast_object_list(value, src=0)
    return value[0]
