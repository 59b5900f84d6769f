"""The one table of stage kinds: which function runs a stage of each config type on every rank.

Each entry imports its module when called, so that a stage loads only its own engine
(megatron-core + DeepSpeed for SFT, verl's protocol for GRPO).
"""

from __future__ import annotations

from core.config import GRPOStage, SFTStage, SynthStage
from runtime.context import StageContext


def run_sft(ctx: StageContext) -> None:
    from stages import sft

    sft.run(ctx)


def run_grpo(ctx: StageContext) -> None:
    from stages.grpo import trainer

    trainer.run(ctx)


def run_synth(ctx: StageContext) -> None:
    from stages import synth

    synth.run(ctx)


STAGE_RUNNERS = {SFTStage: run_sft, GRPOStage: run_grpo, SynthStage: run_synth}
