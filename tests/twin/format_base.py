"""A tiny base model that answers half the time in the R1 format (`<think></think><answer>N</answer>`)
and half the time with the bare sum: sampled answers to one prompt then get different rewards, so GRPO's
advantages, gradients and updates are not all zero from the first step, as they are for a random
model (whose responses all score 0). Taught here in a few seconds with plain Hugging Face."""

from __future__ import annotations

import random
from pathlib import Path

import torch


def teach_format(model_dir: Path, steps: int = 120, seed: int = 0) -> float:
    """Fine-tunes the model at `model_dir` in place; returns the last loss."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.data.tokenizer import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rng = random.Random(seed)
    rows = []
    for i in range(256):
        a, b = rng.randrange(100), rng.randrange(100)
        prompt = encode_prompt(tokenizer, f"{a:02d}+{b:02d}=")
        text = f"<think></think><answer>{a + b}</answer>" if i % 2 else f"{a + b}"
        answer = tokenizer(text, add_special_tokens=False)["input_ids"]
        rows.append((prompt + list(answer) + [tokenizer.eos_token_id], len(prompt)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        batch = [rows[i] for i in torch.randint(len(rows), (16,), generator=generator).tolist()]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids, _ in batch])
        labels = ids.clone()
        for row, (seq, n_prompt) in enumerate(batch):
            labels[row, :n_prompt] = -100
            labels[row, len(seq) :] = -100
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(model_dir)
    return loss.item()
