"""Batched generation with Hugging Face `generate` (KV cache): prompts left-padded into one batch,
responses decoded from the new tokens only."""
from __future__ import annotations

import torch

from stages.data.tokenizer import encode_prompt


def left_padded(prompt_ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for row, ids in enumerate(prompt_ids):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention[row, width - len(ids):] = 1
    return input_ids, attention


@torch.no_grad()
def generate_tokens(model, tokenizer, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                    top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(left-padded prompts, their attention mask, the new tokens [b, <= max_new_tokens]); rows that
    end early are padded after their eos. Greedy when temperature is 0, else sampling from the
    global torch RNG."""
    input_ids, attention = left_padded(prompt_ids, tokenizer.pad_token_id)
    input_ids, attention = input_ids.to(model.device), attention.to(model.device)
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {"do_sample": False}
    out = model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **sampling)
    return input_ids, attention, out[:, input_ids.shape[1]:]


def generate_responses(model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float = 0.0,
                       top_p: float = 1.0) -> list[str]:
    _, _, new_tokens = generate_tokens(model, tokenizer, [encode_prompt(tokenizer, p) for p in prompts],
                                       max_new_tokens, temperature, top_p)
    return tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
