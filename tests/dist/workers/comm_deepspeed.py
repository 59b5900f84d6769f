"""Worker: a few steps of a small model under DeepSpeed ZeRO-1 (gloo) with DeepSpeed's own comms
logger on, under our profiler; writes what the comms logger saw beside the profile."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import deepspeed
import deepspeed.comm as ds_comm
import torch
import torch.distributed as dist

from launch.worker import leave_now
from runtime.comm_profiler import CommProfiler
from runtime.dist import shutdown_distributed
from runtime.phases import phase

CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    "zero_optimization": {"stage": 1},
    "zero_allow_untested_optimizer": True,
    "comms_logger": {"enabled": True, "prof_all": True},
}


def main(out_dir: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    with CommProfiler(Path(out_dir), "stage1_sft", rank) as prof:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
        for step in range(1, 4):
            prof.set_step(step)
            with phase("train"):
                loss = engine(torch.randn(4, 32)).square().mean()
                engine.backward(loss)
                engine.step()
    # {record name: {message size: count}} as DeepSpeed logged it
    seen = {
        name: {str(size): rec[0] for size, rec in sizes.items()}
        for name, sizes in ds_comm.comms_logger.comms_dict.items()
    }
    Path(out_dir, f"comms_logger-{rank}.json").write_text(json.dumps(seen))
    shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
    leave_now(0)
