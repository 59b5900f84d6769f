"""Where the actor's and the reference's models live over the ranks: sharded by FSDP2 or whole on
every rank under DDP (the stage's data_parallel), and in which dtype (stages/engines/precision.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from core.config import GRPOStage
from runtime.dist import rank_device
from stages.engines import ddp, fsdp2
from stages.engines.precision import compute_dtype


def load_role_model(model_dir: Path, stage: GRPOStage, trainable: bool) -> torch.nn.Module:
    """Trainable: fp32 master weights computing in the stage's dtype; frozen: held in that dtype."""
    dtype = role_dtype(stage)
    if stage.data_parallel == "ddp":
        return ddp.load_replicated(model_dir, trainable, dtype)
    return fsdp2.load_sharded(
        model_dir,
        trainable,
        reshard_after_forward=stage.reshard_after_forward,
        units=stage.fsdp_units,
        compute_dtype=dtype,
    )


def role_dtype(stage: GRPOStage) -> torch.dtype:
    """The stage's compute dtype on this rank's device ('auto' resolved)."""
    return compute_dtype(stage.dtype, rank_device())
