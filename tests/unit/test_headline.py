"""The report's headline findings against numbers worked out by hand: the three costliest (operation,
phase) cells of the run with their share of step time, the rank the others waited for, the phase
most blocked in communication."""

from __future__ import annotations

from analysis import headline
from analysis.breakdown import StageSummary
from analysis.matching import match_calls


def collective(
    op: str, phase: str, step: int, seq: int, t: float, transfer: float, late: float = 0.0
) -> list[dict]:
    """One call on ranks 0 and 1; rank 1 arrives `late` seconds after rank 0, both end together."""
    return [
        {
            "rank": rank,
            "step": step,
            "phase": phase,
            "op": op,
            "seq": seq,
            "group_ranks": [0, 1],
            "group_size": 2,
            "bytes": 1024,
            "t_start": t + (late if rank == 1 else 0.0),
            "t_end": t + late + transfer,
            "async_op": False,
            "attempt": 1,
        }
        for rank in (0, 1)
    ]


def stage(name: str, calls: list[tuple], step_walls: dict[str, float]) -> StageSummary:
    """Each call (op, phase, transfer, late) once in each of 2 steps of 1 s (metrics.jsonl)."""
    events = [
        e
        for step in (1, 2)
        for seq, (op, phase, transfer, late) in enumerate(calls)
        for e in collective(op, phase, step, 10 * step + seq, 10.0 * step + seq, transfer, late)
    ]
    lines = [
        {"step": s, "step_time_s": 1.0, **{f"phase_time/{p}": t for p, t in step_walls.items()}}
        for s in (1, 2)
    ]
    walls = {p: 2 * t for p, t in step_walls.items()}
    return StageSummary(name, events, match_calls(events), walls, lines)


def run() -> list[StageSummary]:
    sft = stage(
        "stage1_sft",
        [
            ("broadcast", "forward", 0.01, 0.0),
            ("all_reduce", "backward", 0.1, 0.04),  # rank 1 late: rank 0 waits 40 ms
            ("all_gather", "optimizer", 0.05, 0.0),
            ("all_reduce", "metrics", 0.001, 0.0),
        ],
        {"forward": 0.1, "backward": 0.5, "optimizer": 0.2, "metrics": 0.05},
    )
    grpo = stage("stage2_grpo", [("all_reduce", "policy_update", 0.3, 0.0)], {"policy_update": 0.6})
    return [sft, grpo]


def test_the_three_costliest_cells_of_the_run_with_their_share_of_step_time():
    # backward: rank 0 is in the call 140 ms, rank 1 100 ms: 120 ms per rank a step, 2 steps of 1 s
    assert headline.costliest(run()) == [
        "stage2_grpo: all_reduce in policy_update, 600.0 ms per rank, 30.0% of the stage's step time",
        "stage1_sft: all_reduce in backward, 240.0 ms per rank, 12.0% of the stage's step time",
        "stage1_sft: all_gather in optimizer, 100.0 ms per rank, 5.0% of the stage's step time",
    ]


def test_the_slowest_rank_is_the_one_the_others_waited_for():
    assert headline.slowest_rank(run()) == (
        "Slowest rank: rank 1 of stage1_sft: the others waited 80.00 ms for it; it was the last to arrive, "
        "by more than 1 ms, at 2 calls."
    )


def test_the_most_exposed_phase_is_the_one_rank_0_sat_longest_blocked_in_communication():
    # stage2_grpo's policy_update blocks 600 ms of 1.2 s; stage1_sft's backward 280 ms of 1 s
    assert headline.most_exposed(run()) == (
        "Most exposed communication: policy_update of stage2_grpo: rank 0 sat 600.0 ms blocked in "
        "communication there, 50.0% of the phase's 1.200 s."
    )


def test_a_run_whose_ranks_never_waited_has_no_slowest_rank():
    assert headline.slowest_rank(run()[1:]).startswith("Slowest rank: none")
