"""Overlap of communication with compute, from one rank's own timestamps.

A synchronous call blocks its caller: its time overlaps nothing (0 by definition). An async call
(async_op: DDP's bucketed all-reduce, FSDP2's all-gather/reduce-scatter, functional collectives)
runs while the caller goes on; the part of its interval not covered by the rank's synchronous calls,
nor by the rank's own wait for it (t_wait to t_end, where the profiler saw the wait), is counted as
overlapped. This is an upper bound: the caller may have been idle, not computing.
overlap fraction = overlapped seconds / seconds in the union of all the rank's comm intervals.
"""
from __future__ import annotations

Interval = tuple[float, float]


def union(intervals: list[Interval]) -> list[Interval]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def length(intervals: list[Interval]) -> float:
    return sum(e - s for s, e in union(intervals))


def subtract(intervals: list[Interval], holes: list[Interval]) -> float:
    """Seconds of the union of `intervals` outside the union of `holes`."""
    inside = 0.0
    holes = union(holes)
    for s, e in union(intervals):
        inside += sum(max(0.0, min(e, he) - max(s, hs)) for hs, he in holes)
    return length(intervals) - inside


def overlap_fraction(rank_events: list[dict]) -> float:
    spans = [(e["t_start"], e["t_end"]) for e in rank_events]
    total = length(spans)
    if total == 0:
        return 0.0
    blocked = [(e["t_start"], e["t_end"]) for e in rank_events if not e["async_op"]]
    blocked += [(e["t_wait"], e["t_end"]) for e in rank_events if e["async_op"] and e.get("t_wait") is not None]
    free = [(e["t_start"], e["t_end"]) for e in rank_events if e["async_op"]]
    return subtract(free, blocked) / total
