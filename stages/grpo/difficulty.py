"""Which prompts a GRPO stage trains on (`max_pass_rate`): before the first step, the starting model
answers every prompt `group_size` times at the rollout's temperature, and the prompts it solves more
often than `max_pass_rate` are left out. A group whose answers are all right has no advantage and
teaches nothing: a model that solves most prompts (stage 3's) spends most of its rollouts on them.

Every rank samples its share of the prompts (its own seeded stream, one past the stage's steps), the
counts are summed, and every rank keeps the same prompts. The counts are sampled once a stage and
kept in its run directory (stages/grpo/trainer.py, kept_pass_counts): a resumed stage reads them
back instead of sampling again, so its prompt order is the one it started with."""

from __future__ import annotations

import torch
import torch.distributed as dist

from runtime.dist import rank_device
from stages.data.examples import Example
from stages.rewards.math_reward import score

PROMPTS_PER_CALL = 50  # prompts a rank samples together (times group_size rows)


def pass_counts(rollout, prompts: list[Example], seed_of) -> list[int]:
    """Correct answers of each prompt among the rollout's group_size samples, over all ranks;
    `seed_of(call)` seeds this rank's call-th batch."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    counts = torch.zeros(len(prompts), dtype=torch.float64, device=rank_device())
    mine = list(range(rank, len(prompts), world))
    for call, start in enumerate(range(0, len(mine), PROMPTS_PER_CALL)):
        indices = mine[start : start + PROMPTS_PER_CALL]
        batch = rollout.generate([prompts[i] for i in indices], seed_of(call)).non_tensor_batch
        right = [score(text, answer).correct for text, answer in zip(batch["response_text"], batch["answer"])]
        group = len(right) // len(indices)
        for n, i in enumerate(indices):
            counts[i] = sum(right[n * group : (n + 1) * group])
    if world > 1:
        dist.all_reduce(counts)
    return [int(c) for c in counts.tolist()]


def select_prompts(
    prompts: list[Example], counts: list[int], group_size: int, max_pass_rate: float, needed: int, field: str
) -> list[Example]:
    """The prompts whose share of correct answers is at most `max_pass_rate`; at least `needed` (a
    step's prompts) of them, or a ValueError naming `field`."""
    kept = [p for p, c in zip(prompts, counts, strict=True) if c <= max_pass_rate * group_size + 1e-9]
    if len(kept) < needed:
        raise ValueError(
            f"{field}: only {len(kept)} of {len(prompts)} prompts are solved at most {max_pass_rate:g} "
            f"of the time by the starting model, fewer than a step's {needed}: raise {field}"
        )
    return kept
