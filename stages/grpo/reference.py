"""The reference role: a frozen copy of the stage's starting model, sharded (FSDP2) or whole on every
rank (the stage's data_parallel), giving the log-probabilities the KL term compares the policy against."""
from __future__ import annotations

from pathlib import Path

import torch
from verl.protocol import DataProto

from pipeline.config import GRPOStage
from stages.engines import ddp, fsdp2
from stages.grpo.logprobs import response_log_probs


class Reference:
    def __init__(self, model_dir: Path, stage: GRPOStage):
        if stage.data_parallel == "ddp":
            self.model = ddp.load_replicated(model_dir, trainable=False)
        else:
            self.model = fsdp2.load_sharded(model_dir, trainable=False,
                                            reshard_after_forward=stage.reshard_after_forward, units=stage.fsdp_units)
        self.stage = stage

    @torch.no_grad()
    def compute_ref_log_prob(self, batch: DataProto) -> DataProto:
        log_probs, _ = response_log_probs(self.model, batch, micro_batch_size=self.stage.micro_batch_size,
                                          share_prompts=self.stage.shares_prompts)
        return DataProto.from_dict(tensors={"ref_log_probs": log_probs})
