"""The report's split of a phase into exposed communication and compute cannot go negative: calls
whose clocks run backwards count as empty, exposed communication is at most the phase's wall time,
and the report says where its inputs disagree instead of printing a negative time."""

from __future__ import annotations

import json

from analysis.breakdown import StageSummary
from analysis.matching import match_calls
from analysis.report import write_report


def call(seq: int, phase: str, t_ready: float, t_end: float) -> dict:
    """Rank 0's synchronous all-reduce on CUDA: enqueued 1 ms before its stream reached it."""
    return {
        "stage": "stage2_grpo",
        "step": 1,
        "phase": phase,
        "rank": 0,
        "op": "all_reduce",
        "bytes": 8,
        "dtype": "float32",
        "group_size": 1,
        "group_ranks": [0],
        "peer": None,
        "seq": seq,
        "t_start": t_ready - 1e-3,
        "t_end": t_end,
        "backend": "nccl",
        "source": "torch.distributed",
        "async_op": False,
        "t_wait": None,
        "attempt": 1,
        "t_ready": t_ready,
        "side_stream": False,
    }


# policy_update: 0.4 s of calls in a phase the metrics say lasted 0.3 s; weight_sync: a call of 0.1 s;
# reference_logprob: a call that ends 2 ms before its stream reached it (what one float32 anchor did
# to sub-millisecond calls).
EVENTS = [
    call(0, "policy_update", 100.0, 100.4),
    call(1, "weight_sync", 101.0, 101.1),
    call(2, "reference_logprob", 102.0, 101.998),
]
WALLS = {"policy_update": 0.3, "weight_sync": 0.5, "reference_logprob": 0.2}


def stage() -> StageSummary:
    events = [dict(e) for e in EVENTS]
    metrics = [{"step": 1, **{f"phase_time/{p}": s for p, s in WALLS.items()}}]
    return StageSummary("stage2_grpo", events, match_calls(events), dict(WALLS), metrics)


def test_exposed_communication_is_never_negative_nor_more_than_the_phase():
    split = {name: (wall, exposed, compute) for name, wall, exposed, compute in stage().phase_split()}
    wall, exposed, compute = split["weight_sync"]
    assert (wall, compute) == (0.5, wall - exposed) and abs(exposed - 0.1) < 1e-9
    assert split["reference_logprob"] == (0.2, 0.0, 0.2)
    assert split["policy_update"] == (0.3, 0.3, 0.0)


def test_the_inconsistent_inputs_are_named():
    problems = stage().clock_problems()
    assert len(problems) == 2, problems
    assert problems[0].startswith("1 calls of rank 0 end before they begin (by up to 2000 us)")
    assert problems[1].startswith("phase policy_update: rank 0 blocked in communication 0.400000 s")


def test_the_report_warns_instead_of_printing_a_negative_time(tmp_path):
    stage_dir = tmp_path / "run" / "stage2_grpo"
    (stage_dir / "profile").mkdir(parents=True)
    (stage_dir / "profile" / "rank-00000.jsonl").write_text("".join(json.dumps(e) + "\n" for e in EVENTS))
    metrics = {
        "step": 1,
        "t_start": 99.0,
        "step_time_s": 3.0,
        **{f"phase_time/{p}": s for p, s in WALLS.items()},
    }
    (stage_dir / "metrics.jsonl").write_text(json.dumps(metrics) + "\n")
    write_report([tmp_path / "run"], tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    assert "WARNING, inconsistent times: phase policy_update: rank 0 blocked" in md
    assert "WARNING, inconsistent times: 1 calls of rank 0 end before they begin" in md
    split = md.split("Time by phase (rank 0)", 1)[1].split("\n\n", 2)[1]
    assert "| -" not in split and "-0" not in split, split
