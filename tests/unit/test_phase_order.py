"""Phases come in the order a step runs them, read from the run: the events' first call in each step,
metrics.jsonl for the phases that make no call, setup and the final evaluation last."""

from __future__ import annotations

from analysis.breakdown import StageSummary
from analysis.matching import match_calls
from analysis.phase_order import by_median_position, fill_in

# The GRPO step of docs/design.md: rollout, reward and advantage make no collective call.
STEP = ["weight_sync", "rollout", "reward", "balance", "reference_logprob", "advantage", "policy_update"]
CALLING = ["balance", "policy_update", "none"]  # a step's calls: none's is the step's loss all-reduce


def call(rank: int, step: int, phase: str, t: float) -> dict:
    return {
        "rank": rank,
        "step": step,
        "phase": phase,
        "op": "all_reduce",
        "seq": 0,
        "group_ranks": [rank],
        "t_start": t,
        "t_end": t + 0.001,
        "bytes": 8,
        "async_op": False,
        "attempt": 1,
    }


def grpo_stage(steps: int = 4) -> StageSummary:
    events = [call(r, 0, "none", 0.0) for r in (0, 1)]  # setup
    for step in range(1, steps + 1):
        phases = CALLING + (["checkpoint"] if step % 2 == 0 else [])
        events += [call(r, step, p, step * 10.0 + i + r * 0.1) for r in (0, 1) for i, p in enumerate(phases)]
    events += [call(r, steps + 1, "eval", 1000.0) for r in (0, 1)]
    # metrics.jsonl lists phases as they end; a checkpoint written after step 2's line opens step 3's
    lines = [
        {
            "step": s,
            **({"phase_time/checkpoint": 0.1} if s == 3 else {}),
            **{f"phase_time/{p}": 1.0 for p in STEP},
        }
        for s in range(1, steps + 1)
    ]
    return StageSummary("stage2_grpo", events, match_calls(events), {}, lines)


def test_phases_follow_the_step_not_the_alphabet_and_checkpoint_none_and_eval_come_last():
    assert grpo_stage().phase_order == [*STEP, "none", "checkpoint", "eval"]


def test_the_phase_split_and_the_phase_tables_use_the_step_order():
    s = grpo_stage()
    assert [row[0] for row in s.phase_split()] == ["balance", "policy_update", "none", "checkpoint", "eval"]
    assert sorted(s.volume_by_phase_op(), key=s.phase_key) == [
        "balance",
        "policy_update",
        "none",
        "checkpoint",
        "eval",
    ]


def test_a_nested_phase_follows_its_parent():
    s = grpo_stage()
    names = ["policy_update/grad_sync", "balance", "policy_update", "reward"]
    assert sorted(names, key=s.phase_key) == ["reward", "balance", "policy_update", "policy_update/grad_sync"]


def test_a_new_phase_takes_its_place_from_the_data():
    # "prune" runs between reward and balance; in one step (a rank with nothing to prune?) it first
    # calls after balance: the median keeps it in place
    order = by_median_position(
        [["reward", "prune", "balance"], ["reward", "prune", "balance"], ["balance", "prune"]]
    )
    assert order == ["reward", "prune", "balance"]


def test_metrics_only_phases_go_before_the_next_phase_both_sources_know():
    # the checkpoint heads metrics' order (it ends after its step's line is written); the events
    # place it, and the phases metrics alone know do not follow it there
    events_order = ["balance", "policy_update", "checkpoint"]
    metrics_order = ["checkpoint", "rollout", "balance", "advantage", "policy_update"]
    merged = fill_in(events_order, metrics_order)
    assert merged == ["rollout", "balance", "advantage", "policy_update", "checkpoint"]
