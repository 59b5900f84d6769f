"""Worker: each rank holds a rollout batch of its own prompt and response widths, rank 1's responses
far longer; writes its rows before and after balance_across_ranks. argv = OUT_DIR."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from verl.protocol import DataProto

from launch.worker import leave_now
from runtime.dist import shutdown_distributed
from stages.grpo.balance import balance_across_ranks
from stages.grpo.rollout import sequences

GROUP, MINI_BATCHES, GROUPS_PER_CHUNK, EOS = 2, 2, 3, 1


def rank_batch(rank: int) -> DataProto:
    """Prompts of width 3 + rank (left-padded), responses of width 6 + 8 * rank ending at eos."""
    g = torch.Generator().manual_seed(rank)
    groups = MINI_BATCHES * GROUPS_PER_CHUNK
    prompt_width, response_width = 3 + rank, 6 + 8 * rank
    lengths = torch.randint(1, prompt_width + 1, (groups,), generator=g).repeat_interleave(GROUP)
    prompt = torch.randint(2, 30, (groups, prompt_width), generator=g).repeat_interleave(GROUP, dim=0)
    prompt_mask = (torch.arange(prompt_width) >= prompt_width - lengths[:, None]).long()
    responses = torch.randint(2, 30, (groups * GROUP, response_width), generator=g)
    for row, end in enumerate(torch.randint(0, response_width, (groups * GROUP,), generator=g).tolist()):
        responses[row, end], responses[row, end + 1 :] = EOS, 0
    tensors = sequences(prompt * prompt_mask, prompt_mask, responses, EOS)
    tensors["advantages"] = (
        torch.randn(groups * GROUP, response_width, generator=g) * tensors["response_mask"]
    )
    uid = np.array([f"r{rank}p{row // GROUP}" for row in range(groups * GROUP)], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid}, meta_info={"temperature": 1.0})


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    before = rank_batch(rank)
    after = balance_across_ranks(before, MINI_BATCHES, GROUP)
    for name, batch in (("before", before), ("after", after)):
        torch.save(
            {"tensors": dict(batch.batch.items()), "uid": list(batch.non_tensor_batch["uid"])},
            out_dir / f"{name}-{rank}.pt",
        )
    shutdown_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    leave_now(0)
