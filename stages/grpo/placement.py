"""Where the actor's and the reference's models live over the ranks: sharded by FSDP2 or whole on
every rank under DDP (the stage's data_parallel)."""

from __future__ import annotations

from pathlib import Path

import torch

from core.config import GRPOStage
from stages.engines import ddp, fsdp2


def load_role_model(model_dir: Path, stage: GRPOStage, trainable: bool) -> torch.nn.Module:
    if stage.data_parallel == "ddp":
        return ddp.load_replicated(model_dir, trainable)
    return fsdp2.load_sharded(
        model_dir, trainable, reshard_after_forward=stage.reshard_after_forward, units=stage.fsdp_units
    )
