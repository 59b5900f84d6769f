"""The reference role: a frozen copy of the stage's starting model, sharded (FSDP2) or whole on every
rank (the stage's data_parallel), giving the log-probabilities the KL term compares the policy against."""

from __future__ import annotations

from pathlib import Path

import torch
from verl.protocol import DataProto

from core.config import GRPOStage
from stages.grpo.logprobs import response_log_probs
from stages.grpo.placement import load_role_model


class Reference:
    def __init__(self, model_dir: Path, stage: GRPOStage):
        self.model = load_role_model(model_dir, stage, trainable=False)
        self.stage = stage

    @torch.no_grad()
    def compute_ref_log_prob(self, batch: DataProto) -> DataProto:
        log_probs, _ = response_log_probs(
            self.model,
            batch,
            micro_batch_size=self.stage.micro_batch_size,
            share_prompts=self.stage.shares_prompts,
        )
        return DataProto.from_dict(tensors={"ref_log_probs": log_probs})
