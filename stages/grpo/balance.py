"""Rollout rows moved between ranks so that each rank's share of every mini-batch costs about the
same (verl's trainer.balance_batch).

Each rank samples the responses of its own prompts, and their lengths differ: without this, the
rank with the longer responses sets the pace of the reference pass and of every collective of the
update while the others wait. Whole groups move (a prompt's G responses stay together, as verl keeps
them for its prefix grouper: the log-prob passes forward a prompt once for its group), every rank
keeps the same number of groups in every mini-batch, and the partition is verl's (Karmarkar-Karp
over its workload estimate of each row's tokens), computed from the gathered rows alone: every
rank computes the same one, and a resumed step repeats it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from verl.protocol import DataProto
from verl.utils.seqlen_balancing import get_group_balanced_partitions

from runtime.dist import training_group
from stages.grpo.logprobs import INPUTS

PROMPT_KEYS = ("prompts",)  # [rows, prompt width], left-padded; INPUTS are prompt then response columns


def balance_across_ranks(batch: DataProto, mini_batches: int, group_size: int) -> DataProto:
    """This rank's rows after balancing: its share of mini-batch 0, then of mini-batch 1, ... (so
    that `chunk(mini_batches)` still gives its share of each). The batch holds whole groups of
    `group_size` consecutive rows, `mini_batches` equal chunks of them."""
    group = training_group()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return batch
    everyone = DataProto.concat(gather(batch))
    tokens = everyone.batch["attention_mask"].sum(dim=1).tolist()
    per_rank, per_chunk = len(batch), len(batch) // mini_batches
    mine = []
    for k in range(mini_batches):
        rows = [r * per_rank + k * per_chunk + j for r in range(world) for j in range(per_chunk)]
        # groups are labelled by position, not uid: the same prompt drawn on two ranks stays two groups
        parts = get_group_balanced_partitions(
            [tokens[i] for i in rows], [i // group_size for i in rows], world
        )
        mine += [rows[i] for i in parts[rank]]
    return everyone.select_idxs(mine)


def gather(batch: DataProto) -> list[DataProto]:
    """Every rank's batch, in rank order, padded to the widest prompt and response of any rank."""
    prompt, response = batch.batch["prompts"].shape[1], batch.batch["responses"].shape[1]
    device = batch.batch["responses"].device
    widths = torch.tensor([prompt, response], device=device)
    dist.all_reduce(widths, op=dist.ReduceOp.MAX, group=training_group())
    padded = padded_to(batch, *widths.tolist())
    batches = [None] * dist.get_world_size(training_group())
    # pickled: moved by the host, whatever the device
    dist.all_gather_object(batches, padded.to("cpu"), group=training_group())
    return [b.to(device) for b in batches]


def padded_to(batch: DataProto, prompt_width: int, response_width: int) -> DataProto:
    """Prompt columns left-padded, response columns right-padded with zeros: masked out (attention
    and response masks 0), position 0 as the rollout gives left padding, token 0 for a valid id."""
    t = batch.batch
    extra_prompt = prompt_width - t["prompts"].shape[1]
    extra_response = response_width - t["responses"].shape[1]
    if not extra_prompt and not extra_response:
        return batch
    tensors = {
        key: F.pad(
            value,
            (extra_prompt, extra_response)
            if key in INPUTS
            else (extra_prompt, 0)
            if key in PROMPT_KEYS
            else (0, extra_response),
        )
        for key, value in t.items()
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=batch.non_tensor_batch, meta_info=batch.meta_info)
