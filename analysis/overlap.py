"""Overlap of communication with compute, from one rank's own timestamps.

A synchronous call blocks its caller: its time overlaps nothing (0 by definition). An async call
(async_op: DDP's bucketed all-reduce, FSDP2's all-gather/reduce-scatter, functional collectives;
on CUDA also a call on a side stream: events.beside_caller) runs while the caller goes on; the part
of its interval not covered by the rank's synchronous calls, nor by the rank's own wait for it
(t_wait to t_end, where the profiler saw the wait), is counted as overlapped. This is an upper
bound: the caller may have been idle, not computing.
overlap fraction = overlapped seconds / seconds in the union of all the rank's comm intervals.
"""

from __future__ import annotations

from analysis.events import arrival, beside_caller

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


def intersection(intervals: list[Interval], windows: list[Interval]) -> float:
    """Seconds of the union of `intervals` inside the union of `windows` (one merge pass)."""
    a, b = union(intervals), union(windows)
    i = j = 0
    inside = 0.0
    while i < len(a) and j < len(b):
        inside += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return inside


def subtract(intervals: list[Interval], holes: list[Interval]) -> float:
    """Seconds of the union of `intervals` outside the union of `holes`."""
    return length(intervals) - intersection(intervals, holes)


def span(e: dict) -> Interval:
    """The call's interval; one that ends before it began (inconsistent clocks: `reversed_calls`)
    counts as empty, so that no length built from spans can go negative."""
    start = arrival(e)
    return (start, max(start, e["t_end"]))


def reversed_calls(rank_events: list[dict]) -> list[dict]:
    return [e for e in rank_events if e["t_end"] < arrival(e)]


def blocked(rank_events: list[dict]) -> list[Interval]:
    """When the rank could not go on: inside its synchronous calls and its waits for async ones."""
    spans = [span(e) for e in rank_events if not beside_caller(e)]
    return spans + [
        (e["t_wait"], e["t_end"]) for e in rank_events if beside_caller(e) and e.get("t_wait") is not None
    ]


def overlap_fraction(rank_events: list[dict]) -> float:
    spans = [span(e) for e in rank_events]
    total = length(spans)
    if total == 0:
        return 0.0
    free = [span(e) for e in rank_events if beside_caller(e)]
    return subtract(free, blocked(rank_events)) / total
