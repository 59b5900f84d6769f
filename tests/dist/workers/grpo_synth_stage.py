"""stage3_synth on real ranks with the model's sampling replaced by a seeded stub that answers
correctly, wrongly, malformed, or repeats itself (so the filter has something to reject), and
that makes rank 0 slow (so the work queue has imbalance to absorb). argv = RUN_DIR."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from core.config import RunConfig
from core.rundir import RunDir
from launch.worker import leave_now
from runtime.context import StageContext
from runtime.dist import init_distributed, shutdown_distributed
from stages import synth


def stub_responses(model, tokenizer, prompts, max_new_tokens, temperature, top_p):
    if dist.get_rank() == 0:
        time.sleep(0.3)
    out = []
    for prompt in prompts:
        truth = sum(int(x) for x in prompt.rstrip("=").split("+"))
        kind = int(torch.randint(0, 5, ()))
        out.append(
            [
                f"<think>a</think><answer>{truth}</answer>",
                f"<think>b</think><answer>{truth}</answer>",
                f"<think>a</think><answer>{truth + 1}</answer>",
                f"<answer>{truth}</answer>",
                f"<think>a</think><answer>{truth}</answer>",
            ][kind]
        )
    return out


def main(run_dir: Path) -> None:
    info = init_distributed()
    run = RunDir(run_dir)
    cfg = RunConfig.model_validate(yaml.safe_load(run.config.read_text()))
    synth.generate_responses = stub_responses
    synth.run(StageContext(cfg=cfg, run=run, stage_id="stage3_synth", rank=info))
    shutdown_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    leave_now(0)
