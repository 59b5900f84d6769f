"""The order in which a step runs its phases (rollout before reference_logprob before policy_update,
forward before backward before optimizer), read from the run rather than from a list, so that a new
phase, or another engine's, takes its place without a code change here.

Two sources, each a sequence of phase names a step:
- the communication events: for each (rank, training step), the phases in the order of their first
  call; a phase's place is the median of its position over those sequences (the median, so that the
  odd step that checkpoints, or a rank that calls late, does not move it);
- metrics.jsonl: each line's phase_time keys, in the order the phases ended. These only place the
  phases that made no call (rollout, reward, advantage): a phase that runs after the line is written
  (checkpoint) lands at the head of the next line, where the events know better.
A phase seen outside the training steps only (setup's step 0, the evaluation of final/) comes last,
in the order of its first call.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable


def first_calls(events: Iterable[dict], name_of: Callable[[dict], str]) -> list[list[str]]:
    """For each (rank, step), the names `name_of(event)` in the order of their first call."""
    first: dict[tuple, dict[str, float]] = defaultdict(dict)
    for e in events:
        seen = first[e["rank"], e["step"]]
        name = name_of(e)
        seen[name] = min(seen.get(name, e["t_start"]), e["t_start"])
    return [sorted(seen, key=seen.__getitem__) for seen in first.values()]


def by_median_position(sequences: Iterable[list[str]]) -> list[str]:
    """Names by their median position over the sequences that hold them; ties by the mean, then name."""
    positions: dict[str, list[int]] = defaultdict(list)
    for seq in sequences:
        for i, name in enumerate(seq):
            positions[name].append(i)
    return sorted(
        positions, key=lambda n: (statistics.median(positions[n]), statistics.fmean(positions[n]), n)
    )


def fill_in(order: list[str], other: list[str]) -> list[str]:
    """`order`, with each name that only `other` holds placed right before the nearest name that follows
    it in `other`, else right after the nearest that precedes it: `order` decides wherever both know a
    name. The follower first, because metrics put a checkpoint at the head of a line (above)."""
    merged = list(order)
    for i, name in enumerate(other):
        if name in merged:
            continue
        after = next((n for n in other[i + 1 :] if n in merged), None)
        before = next((n for n in reversed(other[:i]) if n in merged), None)
        if after is not None:
            merged.insert(merged.index(after), name)
        elif before is not None:
            merged.insert(merged.index(before) + 1, name)
        else:
            merged.append(name)
    return merged


def step_order(step_events: list[dict], metrics_lines: list[list[str]], name_of) -> list[str]:
    """The names `name_of` gives the events, in the step's order (see the module's docstring)."""
    return fill_in(by_median_position(first_calls(step_events, name_of)), by_median_position(metrics_lines))
