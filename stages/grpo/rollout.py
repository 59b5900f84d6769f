"""The rollout role: G sampled responses per prompt, batched, with our decode loop and its KV cache
(stages/generation.py).

It keeps its own unsharded copy of the policy (as verl's rollout engine does) that `load_weights`
overwrites with the actor's current parameters before every rollout: generating inside the FSDP2
module pays per-layer all-gathers and hooks at every decoding step (hooks even when kept
unsharded), far more than gathering the full weights into the copy once.
"""

from __future__ import annotations

import numpy as np
import torch
from verl.protocol import DataProto

from runtime.dist import rank_device
from stages.data.examples import Example
from stages.data.tokenizer import encode_prompt
from stages.engines.ddp import load_replicated
from stages.generation import TokenScores, generate_tokens


class Rollout:
    def __init__(
        self,
        model_dir,
        tokenizer,
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        with_log_probs: bool = False,
        dtype: torch.dtype = torch.float32,
    ):
        self.model = load_replicated(model_dir, trainable=False, compute_dtype=dtype)
        self.tokenizer = tokenizer
        self.group_size, self.max_new_tokens = group_size, max_new_tokens
        self.temperature, self.top_p = temperature, top_p
        self.with_log_probs = with_log_probs

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Overwrite this copy's parameters with the actor's, by parameter name (a tied head is
        its embedding's one parameter on both sides), cast to this copy's dtype."""
        own = dict(self.model.named_parameters())
        if own.keys() != weights.keys():
            raise ValueError(f"rollout and actor parameters differ: {sorted(own.keys() ^ weights.keys())}")
        for name, param in own.items():
            param.copy_(weights[name])

    def generate(self, prompts: list[Example], seed: int) -> DataProto:
        """Rows are grouped: the G responses of a prompt are consecutive and share its `uid`. With
        `with_log_probs`, the batch also holds each response token's `rollout_log_probs` and the
        `entropy` of the distribution it was drawn from."""
        torch.manual_seed(seed)
        encoded = [
            encode_prompt(self.tokenizer, ex.prompt) for ex in prompts
        ]  # once a prompt, not once a row
        prompt_ids = [ids for ids in encoded for _ in range(self.group_size)]
        scores = (
            TokenScores(len(prompt_ids), self.max_new_tokens, self.temperature, rank_device())
            if self.with_log_probs
            else None
        )
        prompt, prompt_mask, responses = generate_tokens(
            self.model, self.tokenizer, prompt_ids, self.max_new_tokens, self.temperature, self.top_p, scores
        )
        batch = sequences(prompt, prompt_mask, responses, self.tokenizer.eos_token_id)
        if scores is not None:
            width = responses.shape[1]
            batch.update(rollout_log_probs=scores.log_probs[:, :width], entropy=scores.entropy[:, :width])
        repeat = lambda values: np.array([v for v in values for _ in range(self.group_size)], dtype=object)  # noqa: E731
        non_tensors = {
            "uid": repeat(ex.id for ex in prompts),
            "answer": repeat(ex.answer for ex in prompts),
            "response_text": np.array(
                self.tokenizer.batch_decode(responses, skip_special_tokens=True), dtype=object
            ),
        }
        return DataProto.from_dict(
            tensors=batch, non_tensors=non_tensors, meta_info={"temperature": self.temperature}
        )


def sequences(prompt: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor, eos_id: int) -> dict:
    """Prompt + response as the model reads them. The response mask covers the tokens up to and
    including the first eos (the padding generate adds after it is not the policy's doing);
    positions count only real tokens, as generate counted them for the left-padded prompts."""
    is_eos = (responses == eos_id).int()
    response_mask = ((is_eos.cumsum(dim=1) - is_eos) == 0).long()
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return {
        "prompts": prompt,
        "responses": responses,
        "input_ids": torch.cat([prompt, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask,
    }
