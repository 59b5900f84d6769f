"""Worker: rank 1 is slow on purpose (sleeps before each all-reduce of phase "slow"); rank 0 must
end up waiting for it.

Rank 1 starts its sleep only once rank 0 has reached the call (a marker file rank 0 writes right
before it), so however late a loaded machine runs rank 0 up to there, rank 1 still arrives DELAY_S
after it. Only a stall of rank 0 between writing its marker and entering the call, a few lines
that take microseconds, eats into that lead: it would have to last DELAY_S to make rank 0 the
straggler."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from launch.worker import leave_now
from runtime.comm_profiler import CommProfiler
from runtime.dist import shutdown_distributed
from runtime.phases import phase

SLOW_RANK, DELAY_S, CALLS = 1, 0.3, 3
POLL_S = 0.005


def arrive(markers: Path, step: int, rank: int) -> None:
    """Rank 0 says it is at the call; the slow rank waits for that, then sleeps DELAY_S."""
    marker = markers / f"step-{step}"
    if rank != SLOW_RANK:
        marker.touch()
        return
    while not marker.exists():
        time.sleep(POLL_S)
    time.sleep(DELAY_S)


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    markers = Path(out_dir).parent / "arrived"  # beside the profile, not in it
    markers.mkdir(parents=True, exist_ok=True)
    with CommProfiler(Path(out_dir), "stage1_sft", rank) as prof:
        for step in range(1, CALLS + 1):
            prof.set_step(step)
            with phase("slow"):
                arrive(markers, step, rank)
                dist.all_reduce(torch.ones(10_000))
    shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
    leave_now(0)
