"""The one table of stage kinds: which module runs a stage of each config type on every rank.

A stage imports its module when it starts, so that it loads only its own engine (megatron-core +
DeepSpeed for SFT, verl's protocol for GRPO); the local launcher preloads that module once for all
of a node's ranks (launch/torchrun.py).
"""

from __future__ import annotations

import importlib

from core.config import GRPOStage, SFTStage, SynthStage
from runtime.context import StageContext

STAGE_MODULES = {SFTStage: "stages.sft", GRPOStage: "stages.grpo.trainer", SynthStage: "stages.synth"}


def run_stage(ctx: StageContext) -> None:
    """Run ctx's stage on this rank: its module's `run(ctx)`."""
    importlib.import_module(STAGE_MODULES[type(ctx.stage)]).run(ctx)
