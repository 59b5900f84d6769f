"""Balancing rollout rows over 2 real ranks (verl's balance_batch, per mini-batch, whole groups):
every row survives unchanged apart from padding, stays in its mini-batch and its group, each rank
keeps its row count, and the ranks' token counts in every mini-batch move closer together."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import REPO, run_torchrun
from tests.dist.workers.balance import GROUP, MINI_BATCHES

pytestmark = pytest.mark.dist
WORKER = REPO / "tests" / "dist" / "workers" / "balance.py"


@pytest.fixture(scope="module")
def balanced(tmp_path_factory):
    out = tmp_path_factory.mktemp("balance")
    run_torchrun(WORKER, 2, str(out), timeout=120)
    return {
        name: [torch.load(out / f"{name}-{rank}.pt") for rank in range(2)] for name in ("before", "after")
    }


def rows(saved: dict) -> list[tuple]:
    """Each row as (uid, real prompt tokens, real response tokens, their positions, advantages):
    what must survive the move, padding stripped."""
    t = saved["tensors"]
    width = t["prompts"].shape[1]
    out = []
    for i, uid in enumerate(saved["uid"]):
        prompt_mask, response_mask = t["attention_mask"][i, :width].bool(), t["response_mask"][i].bool()
        out.append(
            (
                uid,
                tuple(t["prompts"][i][prompt_mask].tolist()),
                tuple(t["responses"][i][response_mask].tolist()),
                tuple(t["position_ids"][i][t["attention_mask"][i].bool()].tolist()),
                tuple(t["advantages"][i][response_mask].tolist()),
            )
        )
    return out


def chunks(saved: dict) -> list[list[tuple]]:
    per_chunk = len(saved["uid"]) // MINI_BATCHES
    return [rows(saved)[k * per_chunk : (k + 1) * per_chunk] for k in range(MINI_BATCHES)]


def tokens(saved: dict, k: int) -> int:
    per_chunk = len(saved["uid"]) // MINI_BATCHES
    return int(saved["tensors"]["attention_mask"][k * per_chunk : (k + 1) * per_chunk].sum())


def test_every_row_keeps_its_values_its_mini_batch_and_its_group(balanced):
    before, after = balanced["before"], balanced["after"]
    assert [len(s["uid"]) for s in after] == [len(s["uid"]) for s in before]
    for k in range(MINI_BATCHES):
        assert sorted(chunks(after[0])[k] + chunks(after[1])[k]) == sorted(
            chunks(before[0])[k] + chunks(before[1])[k]
        )
    for saved in after:
        uids = saved["uid"]
        assert all(len(set(uids[i : i + GROUP])) == 1 for i in range(0, len(uids), GROUP)), uids


def test_rows_move_and_the_ranks_token_counts_move_closer_in_every_mini_batch(balanced):
    before, after = balanced["before"], balanced["after"]
    moved = sum(uid.startswith("r1") for uid in after[0]["uid"])
    assert moved > 0, "rank 1's longer responses must be shared out"
    for k in range(MINI_BATCHES):
        gap_before = abs(tokens(before[0], k) - tokens(before[1], k))
        gap_after = abs(tokens(after[0], k) - tokens(after[1], k))
        print(f"mini-batch {k}: token gap {gap_before} -> {gap_after}")
        assert gap_after < gap_before / 2, (k, gap_before, gap_after)
