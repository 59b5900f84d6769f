"""Worker: every kind of torch.distributed call once, each in a phase named after it, under the
profiler; then a few steps of DDP and of FSDP2 training. Writes the reference sizes beside the
profile so the test can compare without importing the model."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import all_reduce as all_reduce_imported_early  # a caller the profiler must still see
from torch.distributed.fsdp import fully_shard

from launch.worker import leave_now
from runtime.comm_profiler import CommProfiler
from runtime.dist import shutdown_distributed
from runtime.phases import phase

N = 1000  # float32 elements per tensor: 4000 bytes


def every_op(rank: int, world: int) -> None:
    x = torch.ones(N)
    calls = {
        "all_reduce": lambda: dist.all_reduce(x),
        "all_reduce_imported_early": lambda: all_reduce_imported_early(x),
        "all_reduce_async": lambda: dist.all_reduce(x, async_op=True).wait(),
        "all_gather": lambda: dist.all_gather([torch.empty(N) for _ in range(world)], x),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(N * world), x),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(N // world), x),
        "broadcast": lambda: dist.broadcast(x, 0),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(N), x),
        "send_recv": lambda: dist.send(x, 1) if rank == 0 else dist.recv(x, 0),
        "isend_irecv": lambda: (dist.isend(x, 1) if rank == 0 else dist.irecv(x, 0)).wait(),
        "barrier": lambda: dist.barrier(),
        "functional_all_reduce": lambda: funcol.all_reduce(x, "sum", dist.group.WORLD).wait(),
    }
    for name, call in calls.items():
        with phase(name):
            call()
    with phase("inference_mode"), torch.inference_mode():
        y = torch.ones(N)
        dist.all_reduce(y)
        dist.all_gather_into_tensor(torch.empty(N * world), y)
        dist.broadcast(y, 0)
        dist.barrier()
        funcol.all_reduce(y, "sum", dist.group.WORLD).wait()
    with phase("batch_isend_irecv"):
        op = dist.isend if rank == 0 else dist.irecv
        for work in dist.batch_isend_irecv([dist.P2POp(op, x, 1 - rank)]):
            work.wait()
    waited_out_of_order(rank)


def waited_out_of_order(rank: int) -> None:
    """Two sends waited on in reverse order, 0.3 s apart: each call's completion is its own wait."""
    first, second = torch.ones(N // 2), torch.ones(N)
    with phase("waited_out_of_order"):
        if rank == 0:
            works = [dist.isend(first, 1), dist.isend(second, 1)]
            works[1].wait()
            time.sleep(0.3)
            works[0].wait()
        else:
            dist.recv(first, 0)
            dist.recv(second, 0)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(33, 64), torch.nn.ReLU(), torch.nn.Linear(64, 7))


def train(wrapped: torch.nn.Module, params, prof: CommProfiler, name: str, first_step: int) -> None:
    opt = torch.optim.SGD(params, lr=0.1)
    for step in range(first_step, first_step + 3):
        prof.set_step(step)
        with phase(name):
            wrapped(torch.randn(8, 33)).square().mean().backward()
            opt.step()
            opt.zero_grad()


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with CommProfiler(Path(out_dir), "test", rank) as prof:
        every_op(rank, world)
        ddp = torch.nn.parallel.DistributedDataParallel(model())
        train(ddp, ddp.parameters(), prof, "ddp", first_step=1)
        fsdp = model()
        fully_shard(fsdp)
        train(fsdp, fsdp.parameters(), prof, "fsdp2", first_step=4)
    if rank == 0:
        params = list(model().parameters())
        # FSDP2 shards dim 0 evenly: each parameter is padded to a multiple of the world size there.
        padded = sum(-(-p.shape[0] // world) * world * p[0].numel() * p.element_size() for p in params)
        Path(out_dir, "reference.json").write_text(
            json.dumps(
                {"grad_bytes": sum(p.numel() * p.element_size() for p in params), "padded_grad_bytes": padded}
            )
        )
    shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
    leave_now(0)
