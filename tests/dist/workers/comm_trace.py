"""Worker: a few collectives in phases under torch.profiler AND the comm profiler at once; writes
the chrome trace per rank so the parser's events can be compared with the recorded ones."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from launch.worker import leave_now
from runtime.comm_profiler import CommProfiler
from runtime.dist import shutdown_distributed
from runtime.phases import phase


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.ones(1000)
    with (
        CommProfiler(Path(out_dir), "trace", rank),
        profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p,
    ):
        with phase("policy_update"):
            dist.all_reduce(x)
            dist.all_gather_into_tensor(torch.empty(1000 * world), x)
        with phase("reference_logprob"):
            dist.reduce_scatter_tensor(torch.empty(1000 // world), x)
            dist.broadcast(x.double(), 0)
    p.export_chrome_trace(str(Path(out_dir) / f"trace-rank{rank}.json"))
    shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
    leave_now(0)
