"""Which prompts a step trains on, and which of them this rank holds.

The order is rebuilt from (seed, step) alone, so resuming needs only the step. The global batch is
first cut into the mini-batches of the update and each mini-batch is then split over the ranks:
so mini-batch m on any number of ranks is the same set of prompts, and a step on N ranks is the
same optimisation as on one rank.
"""

from __future__ import annotations

from stages.data.examples import Example
from stages.data.sft_batches import GlobalBatchOrder


class PromptSchedule:
    def __init__(self, prompts: list[Example], prompts_per_step: int, seed: int):
        self.prompts = prompts
        self.order = GlobalBatchOrder(len(prompts), prompts_per_step, seed)

    def global_batch(self, step: int) -> list[Example]:
        return [self.prompts[i] for i in self.order.indices(step)]


def rank_share(global_batch: list, rank: int, world: int, mini_batches: int) -> list:
    """This rank's part of every mini-batch, concatenated in mini-batch order (so the local batch
    cuts into `mini_batches` equal contiguous chunks that line up across ranks)."""
    per_rank = len(global_batch) // (world * mini_batches)
    return [
        item
        for block in range(mini_batches)
        for item in global_batch[(block * world + rank) * per_rank : (block * world + rank + 1) * per_rank]
    ]
