"""Validation and held-out accuracy: greedy answers, and k answers sampled at the rollout temperature
(their mean accuracy, mean@k: R1's pass@1 estimate), scored by the task's verifiable reward. Under
torch.distributed each rank scores its share of the examples, with the model in its own dtype on the
rank's device, and the counts are summed.

The validation split is what tuning decisions read; the held-out split is only reported."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from core.config import EvalConfig
from runtime.dist import rank_device
from runtime.preemption import leave_if_requested, signalled
from stages.data.examples import Example
from stages.data.tokenizer import load_tokenizer
from stages.generation import generate_in_batches
from stages.rewards.math_reward import score

log = logging.getLogger("hpcr1.eval")


def evaluate(model, tokenizer, examples: list[Example], settings: EvalConfig, seed: int = 0) -> dict:
    """Greedy accuracy over `examples`, and with `settings.samples` (k) > 0 the mean accuracy of k
    answers a problem sampled at `settings.temperature` (the draws seeded from `seed` and the rank;
    the global torch RNG is reseeded)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = examples[rank::world]
    device = next(model.parameters()).device
    # greedy then sampled: correct, well-formed, scored
    counts = torch.zeros(6, dtype=torch.float64, device=device)
    model.eval()
    started = time.perf_counter()
    counts[:3] += _generate_and_tally(model, tokenizer, mine, settings, 0.0)
    leave_if_requested(log, "while evaluating final/")
    greedy_s = time.perf_counter() - started
    k = settings.samples
    if k:
        torch.manual_seed(seed * 1009 + rank)
        rows = [ex for ex in mine for _ in range(k)]  # each problem's k answers side by side
        counts[3:] += _generate_and_tally(model, tokenizer, rows, settings, settings.temperature)
        leave_if_requested(log, "while evaluating final/")
    sampled_s = time.perf_counter() - started - greedy_s
    if world > 1:
        dist.all_reduce(counts)
    result = accuracy_of(counts[:3].tolist())
    if k:
        result.update(mean_at_k(counts[3:].tolist(), k), temperature=settings.temperature)
    # rank 0's wall time of each part: what the k samples cost beside the greedy answers
    result["seconds"] = {"greedy": round(greedy_s, 3), "sampled": round(sampled_s, 3)}
    return result


def _generate_and_tally(model, tokenizer, rows: list[Example], settings: EvalConfig, temperature: float):
    """[correct, well-formed, scored] of `rows`, a batch at a time; the rows left when a preemption
    signal comes are not answered (the caller then stops the stage, leave_if_requested)."""
    tallies = torch.zeros(3, dtype=torch.float64, device=next(model.parameters()).device)
    for start in range(0, len(rows), settings.batch_size):
        if signalled():
            break
        batch = rows[start : start + settings.batch_size]
        responses = generate_in_batches(
            model, tokenizer, [ex.prompt for ex in batch], settings.max_new_tokens, temperature, len(batch)
        )
        tallies += torch.tensor(tally(batch, responses), dtype=torch.float64, device=tallies.device)
    return tallies


def tally(examples: list[Example], responses: list[str]) -> list[int]:
    """[correct, well-formed, scored] of one answer per example, whichever engine wrote them."""
    scores = [score(response, ex.answer) for ex, response in zip(examples, responses, strict=True)]
    return [sum(s.correct for s in scores), sum(s.format_ok for s in scores), len(scores)]


def accuracy_of(counts: list[float]) -> dict:
    correct, well_formed, n = counts
    return {"accuracy": correct / max(n, 1), "format_rate": well_formed / max(n, 1), "n": int(n)}


def mean_at_k(counts: list[float], k: int) -> dict:
    """mean@k from the counts of k answers a problem: every problem has k, so the mean over problems
    of each one's share of correct answers is the share of all answers that are correct."""
    correct, well_formed, scored = counts
    if scored % k:
        raise ValueError(f"{scored:g} sampled answers are not k = {k} a problem")
    return {"mean_at_k": correct / max(scored, 1), "format_rate_at_k": well_formed / max(scored, 1), "k": k}


def evaluate_model_dir(
    model_dir: Path,
    examples: list[Example],
    settings: EvalConfig,
    seed: int = 0,
    validation: list[Example] | None = None,
) -> dict:
    """The held-out result of the model in `model_dir`, with the validation set's under "validation"
    where one is given."""
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").to(rank_device())
    result = evaluate(model, tokenizer, examples, settings, seed)
    if validation:
        result["validation"] = evaluate(model, tokenizer, validation, settings, seed)
    # where rank 0 evaluated: on a GPU node the GPU, in the dtype the model was saved in
    return {**result, "device": rank_device().type, "dtype": str(model.dtype).removeprefix("torch.")}
