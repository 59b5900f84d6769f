"""Worker: rank 1 is slow on purpose (sleeps before each all-reduce of phase "slow"); rank 0 must
end up waiting for it."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from runtime.comm_profiler import CommProfiler
from runtime.dist import shutdown_distributed
from runtime.phases import phase

SLOW_RANK, DELAY_S, CALLS = 1, 0.3, 3


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with CommProfiler(Path(out_dir), "stage1_sft", rank) as prof:
        for step in range(1, CALLS + 1):
            prof.set_step(step)
            with phase("slow"):
                if rank == SLOW_RANK:
                    time.sleep(DELAY_S)
                dist.all_reduce(torch.ones(10_000))
    shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
