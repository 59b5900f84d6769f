"""Held-out accuracy: greedy answers scored by the task's verifiable reward. Under torch.distributed
each rank scores its share of the examples, with the model in its own dtype on the rank's device,
and the counts are summed."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from runtime.dist import rank_device
from stages.data.examples import Example
from stages.data.tokenizer import load_tokenizer
from stages.generation import generate_responses
from stages.rewards.math_reward import score


def evaluate(model, tokenizer, examples: list[Example], max_new_tokens: int, batch_size: int = 50) -> dict:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = examples[rank::world]
    device = next(model.parameters()).device
    counts = torch.zeros(3, dtype=torch.float64, device=device)  # correct, well-formed, scored
    model.eval()
    for i in range(0, len(mine), batch_size):
        chunk = mine[i : i + batch_size]
        responses = generate_responses(model, tokenizer, [ex.prompt for ex in chunk], max_new_tokens)
        counts += torch.tensor(tally(chunk, responses), dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(counts)
    return accuracy_of(counts.tolist())


def tally(examples: list[Example], responses: list[str]) -> list[int]:
    """[correct, well-formed, scored] of one answer per example, whichever engine wrote them."""
    scores = [score(response, ex.answer) for ex, response in zip(examples, responses, strict=True)]
    return [sum(s.correct for s in scores), sum(s.format_ok for s in scores), len(scores)]


def accuracy_of(counts: list[float]) -> dict:
    correct, well_formed, n = counts
    return {"accuracy": correct / max(n, 1), "format_rate": well_formed / max(n, 1), "n": int(n)}


def evaluate_model_dir(
    model_dir: Path, examples: list[Example], max_new_tokens: int, batch_size: int = 50
) -> dict:
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").to(rank_device())
    result = evaluate(model, tokenizer, examples, max_new_tokens, batch_size)
    # where rank 0 evaluated: on a GPU node the GPU, in the dtype the model was saved in
    return {**result, "device": rank_device().type, "dtype": str(model.dtype).removeprefix("torch.")}
