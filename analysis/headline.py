"""The report's opening lines for a run: where its communication time went, which rank held the others
up, and which phase sat blocked in communication the longest. Read off the stage summaries
(analysis/breakdown.py), the numbers of the tables further down, so that the two agree."""

from __future__ import annotations

from analysis.breakdown import STRAGGLER_MIN_WAIT_S, StageSummary
from analysis.tables import elapsed


def costliest(stages: list[StageSummary], k: int = 3) -> list[str]:
    """The k (stage, op, phase) cells with the most communication time per rank, each with its share
    of the stage's step time (StageSummary.step_seconds)."""
    cells = [
        (volume.seconds, s, op, phase)
        for s in stages
        for phase, ops in s.volume_by_phase_op().items()
        for op, volume in ops.items()
        if volume.seconds > 0
    ]
    lines = []
    for seconds, s, op, phase in sorted(cells, key=lambda c: -c[0])[:k]:
        total = s.step_seconds()
        share = f", {seconds / total:.1%} of the stage's step time" if total > 0 else ""
        lines.append(f"{s.name}: {op} in {phase}, {elapsed(seconds)} per rank{share}")
    return lines


def slowest_rank(stages: list[StageSummary]) -> str:
    """The rank of a stage that the others waited for the longest, summed over the calls it was the
    last to arrive at (analysis/matching.py)."""
    held = [(seconds, count, s, rank) for s in stages for rank, (count, seconds) in s.held_up().items()]
    if not any(seconds > 0 for seconds, *_ in held):
        return "Slowest rank: none (no call was matched across ranks with a rank waiting for another)."
    seconds, count, s, rank = max(held, key=lambda h: (h[0], h[1]))
    return (
        f"Slowest rank: rank {rank} of {s.name}: the others waited {elapsed(seconds)} for it; it was the "
        f"last to arrive, by more than {STRAGGLER_MIN_WAIT_S * 1e3:g} ms, at {count} calls."
    )


def most_exposed(stages: list[StageSummary]) -> str:
    """The top-level phase with the most communication that blocked rank 0 (not overlapped)."""
    rows = [(exposed, wall, s, phase) for s in stages for phase, wall, exposed, _ in s.phase_split()]
    exposed, wall, s, phase = max(rows, key=lambda r: r[0], default=(0.0, 0.0, None, ""))
    if s is None or exposed <= 0:
        return "Most exposed communication: none (no call blocked rank 0)."
    return (
        f"Most exposed communication: {phase} of {s.name}: rank 0 sat {elapsed(exposed)} blocked in "
        f"communication there, {exposed / wall:.1%} of the phase's {elapsed(wall)}."
    )
