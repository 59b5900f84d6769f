"""Matching one collective across the ranks that took part, by (group_ranks, op, attempt, seq): seq
counts a (group, op)'s calls from the start of each attempt of the stage.

For a matched call, the rank that arrives last is the straggler: the others wait for it. A rank
arrives when its stream reaches the call (t_ready, on CUDA: the host enqueues ahead of the GPU, so
t_start says little there), else when it makes the call (t_start). Wait on rank r = latest arrival -
arrival on r; transfer time = earliest t_end - latest arrival (once everyone is there, the data
moves). This differs from "t_end minus the earliest t_end"
on purpose: a collective completes at about the same moment everywhere, so completion skew hides who
waited; arrival skew shows it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from analysis.events import arrival


@dataclass
class MatchedCall:
    op: str
    group_ranks: tuple[int, ...]
    attempt: int
    seq: int
    phase: str
    step: int
    bytes: int
    events: dict[int, dict]  # rank -> its event

    @property
    def last_arrival(self) -> float:
        return max(map(arrival, self.events.values()))

    @property
    def slow_rank(self) -> int:
        return max(self.events, key=lambda r: arrival(self.events[r]))

    def wait(self, rank: int) -> float:
        return self.last_arrival - arrival(self.events[rank])

    @property
    def transfer_s(self) -> float:
        return max(0.0, min(e["t_end"] for e in self.events.values()) - self.last_arrival)


def match_calls(events: list[dict]) -> list[MatchedCall]:
    """Calls seen on every rank of their group (point-to-point and partial profiles are left out)."""
    by_key: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for e in events:
        if e["op"] not in ("send", "recv"):
            by_key[(tuple(e["group_ranks"]), e["op"], e["attempt"], e["seq"])][e["rank"]] = e
    calls = []
    for (ranks, op, attempt, seq), per_rank in by_key.items():
        if len(per_rank) == len(ranks) > 1:
            first = per_rank[ranks[0]]
            calls.append(
                MatchedCall(op, ranks, attempt, seq, first["phase"], first["step"], first["bytes"], per_rank)
            )
    return sorted(calls, key=lambda c: c.last_arrival)


def wait_by_rank(calls: list[MatchedCall]) -> dict[int, float]:
    """Seconds each rank spent waiting for others, summed over matched calls."""
    waits: dict[int, float] = defaultdict(float)
    for call in calls:
        for rank in call.events:
            waits[rank] += call.wait(rank)
    return dict(waits)


def held_up(calls: list[MatchedCall], min_wait_s: float = 0.0) -> dict[int, tuple[int, float]]:
    """rank -> (how often it was the last to arrive with others waiting more than min_wait_s, the
    seconds the others waited for it over every call it was the last to arrive at)."""
    held: dict[int, tuple[int, float]] = {}
    for call in calls:
        waits = [call.wait(r) for r in call.events]
        count, seconds = held.get(call.slow_rank, (0, 0.0))
        held[call.slow_rank] = (count + (max(waits) > min_wait_s), seconds + sum(waits))
    return held


def straggler_counts(calls: list[MatchedCall], min_wait_s: float = 0.0) -> dict[int, int]:
    """How often each rank was the last to arrive (with others waiting more than min_wait_s)."""
    return {rank: count for rank, (count, _) in held_up(calls, min_wait_s).items() if count}
