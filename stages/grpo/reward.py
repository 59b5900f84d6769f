"""The reward role: a verifiable, rule-based score per response (format and correctness), placed
on the response's last token as verl's outcome rewards are. The scoring function is the math
reward used for evaluation too."""

from __future__ import annotations

import numpy as np
import torch
from verl.protocol import DataProto

from stages.rewards.math_reward import score, start_symbolic_worker


class RuleReward:
    def __init__(self, format_weight: float):
        self.format_weight = format_weight
        start_symbolic_worker()  # its start-up overlaps whatever the trainer loads next

    def __call__(self, batch: DataProto) -> DataProto:
        scores = [
            score(text, answer, format_weight=self.format_weight)
            for text, answer in zip(batch.non_tensor_batch["response_text"], batch.non_tensor_batch["answer"])
        ]
        mask = batch.batch["response_mask"]
        last = mask.sum(dim=1).clamp(min=1) - 1
        rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        rewards[torch.arange(len(scores), device=mask.device), last] = torch.tensor(
            [s.reward for s in scores], device=mask.device
        )
        return DataProto.from_dict(
            tensors={"token_level_rewards": rewards},
            non_tensors={
                "correct": np.array([s.correct for s in scores]),
                "format_ok": np.array([s.format_ok for s in scores]),
            },
        )
