"""One stage's communication, summarised: by operation, by phase, per rank, the costliest calls.

Times are per-rank averages (sum over ranks / number of ranks) unless a table says "per rank".
Bus bandwidth uses the transfer time of matched calls (after the last rank arrived), so that
waiting for a straggler does not read as a slow network; unmatched calls use their own duration.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from analysis.bandwidth import bus_bandwidth
from analysis.events import arrival, load_events, load_metrics, load_phase_times, phase_times
from analysis.matching import MatchedCall, held_up, match_calls, straggler_counts, wait_by_rank
from analysis.overlap import length, overlap_fraction, reversed_calls, span
from analysis.phase_order import by_median_position, first_calls, step_order

GRPO_PANELS = ("policy_update", "policy_logprob", "reference_logprob")
STRAGGLER_MIN_WAIT_S = 1e-3  # a rank is the straggler of a call only where others waited longer
# Exposed communication may exceed its phase's wall time by this much (relative, then absolute:
# host and device timestamps of a call and of a phase differ by launch latencies) before it is reported.
PHASE_CLOCK_TOLERANCE = 0.01
PHASE_CLOCK_SLACK_S = 1e-3


def top_phase(phase: str) -> str:
    return phase.split("/", 1)[0]


def duration(e: dict) -> float:
    """Seconds in the call: on CUDA from when its stream reached it, the GPU queue ahead left out."""
    return max(0.0, e["t_end"] - arrival(e))


@dataclass
class Volume:
    """Communication of one (phase, op) cell: calls, bytes S (nccl-tests' sense) and seconds."""

    calls: float = 0
    bytes: float = 0
    seconds: float = 0.0

    def add(self, e: dict) -> None:
        self.calls += 1
        self.bytes += e["bytes"]
        self.seconds += duration(e)

    def per_rank(self, ranks: int) -> Volume:
        return Volume(self.calls / ranks, self.bytes / ranks, self.seconds / ranks)


@dataclass
class StageSummary:
    name: str
    events: list[dict]
    calls: list[MatchedCall]
    phase_wall: dict[str, float]
    ranks: list[int] = field(init=False)
    steps: int = field(init=False)
    metrics: list[dict] = field(default_factory=list)  # metrics.jsonl's lines, [] when none

    def __post_init__(self):
        self.ranks = sorted({e["rank"] for e in self.events})
        self.steps = len({e["step"] for e in self.step_events()}) or 1

    def step_events(self) -> list[dict]:
        """The events of the stage's steps: not setup (step 0) and not the held-out evaluation of
        final/ (its own step after the last), which a "per step" figure must not spread over the steps."""
        return [e for e in self.events if e["step"] and not e["phase"].startswith("eval")]

    @cached_property
    def phase_order(self) -> list[str]:
        """Top-level phases in the order a step runs them (analysis/phase_order.py), then those seen
        only outside the training steps (setup, the evaluation of final/) by their first call."""
        lines = [[name for name in phase_times(row) if "/" not in name] for row in self.metrics]
        order = step_order(self.step_events(), lines, lambda e: top_phase(e["phase"]))
        by_time = sorted(self.events, key=lambda e: e["t_start"])
        return order + [p for p in dict.fromkeys(top_phase(e["phase"]) for e in by_time) if p not in order]

    @cached_property
    def _nested_order(self) -> dict[str, int]:
        names = by_median_position(first_calls(self.events, lambda e: e["phase"]))
        return {name: i for i, name in enumerate(names)}

    def phase_key(self, name: str) -> tuple:
        """Sorts phase names in step order; a nested one (a/b) after its parent, among its siblings
        by when it first called in a step."""
        top = top_phase(name)
        place = self.phase_order.index(top) if top in self.phase_order else len(self.phase_order)
        return (place, name != top, self._nested_order.get(name, len(self._nested_order)), name)

    def step_seconds(self) -> float:
        """The stage's wall time in its steps: metrics' step_time_s summed, else (a stage that logs no
        step time, as synthesis) its top-level phases' wall time; 0.0 when metrics say neither."""
        steps = [row["step_time_s"] for row in self.metrics if "step_time_s" in row]
        return sum(steps) if steps else sum(self._top_level_walls().values())

    def per_rank_mean(self, seconds: float) -> float:
        return seconds / max(1, len(self.ranks))

    def comm_seconds_per_step(self) -> float:
        return self.per_rank_mean(sum(duration(e) for e in self.step_events())) / self.steps

    def bytes_per_step(self) -> float:
        return sum(e["bytes"] for e in self.step_events() if e["rank"] == self.ranks[0]) / self.steps

    def by_op(self) -> list[tuple]:
        """(op, calls per rank, bytes per rank, seconds per rank, median bus bandwidth B/s), costliest
        first."""
        rows = [
            (op, int(v.calls), int(v.bytes), v.seconds, self.median_busbw(op))
            for op, v in self._volume_by(lambda e: e["op"])
        ]
        return sorted(rows, key=lambda r: -r[3])

    def by_origin(self) -> list[tuple]:
        """(source, backend, op, calls per rank, bytes per rank, seconds per rank): who made the calls and
        what carried them, e.g. mpi4py's rank discovery beside torch.distributed's calls on gloo."""
        by = lambda e: (e["source"], e["backend"], e["op"])  # noqa: E731
        return [(*key, int(v.calls), int(v.bytes), v.seconds) for key, v in self._volume_by(by)]

    def _volume_by(self, key) -> list[tuple[object, Volume]]:
        """(key, its calls' volume per rank) for each value of key(event), in key order."""
        table: dict[object, Volume] = defaultdict(Volume)
        for e in self.events:
            table[key(e)].add(e)
        return [(k, v.per_rank(max(1, len(self.ranks)))) for k, v in sorted(table.items())]

    def bandwidth_points(self, op: str) -> list[tuple[int, float]]:
        """(bytes, bus bandwidth B/s) for each call of `op`, one point per matched call."""
        matched = {(c.group_ranks, c.attempt, c.seq) for c in self.calls if c.op == op}
        points = [
            (c.bytes, bus_bandwidth(op, c.bytes, c.transfer_s, len(c.group_ranks)))
            for c in self.calls
            if c.op == op and c.transfer_s > 0
        ]
        points += [
            (e["bytes"], bus_bandwidth(op, e["bytes"], duration(e), e["group_size"]))
            for e in self.events
            if e["op"] == op
            and (tuple(e["group_ranks"]), e["attempt"], e["seq"]) not in matched
            and duration(e) > 0
            and e["group_size"] > 1  # a group of one moves nothing (megatron's tensor-parallel group at TP 1)
        ]
        return [p for p in points if p[0] > 0]

    def median_busbw(self, op: str) -> float:
        points = self.bandwidth_points(op)
        return statistics.median(b for _, b in points) if points else 0.0

    def by_phase_op(self) -> dict[str, dict[str, float]]:
        """phase -> op -> seconds per rank (full nested phase names)."""
        return {p: {op: v.seconds for op, v in ops.items()} for p, ops in self.volume_by_phase_op().items()}

    def volume_by_phase_op(self, phase_of=lambda name: name) -> dict[str, dict[str, Volume]]:
        """phase -> op -> calls, bytes and seconds per rank; `phase_of` maps a recorded phase to the
        row it counts in (e.g. `top_phase`, so that nested phases add up in their parent)."""
        table: dict[str, dict[str, Volume]] = defaultdict(lambda: defaultdict(Volume))
        for e in self.events:
            table[phase_of(e["phase"])][e["op"]].add(e)
        per_rank = max(1, len(self.ranks))
        return {p: {op: v.per_rank(per_rank) for op, v in ops.items()} for p, ops in table.items()}

    def grpo_panels(self) -> dict[str, dict[str, Volume]]:
        """GRPO's three phases compared side by side (policy update, policy and reference log-probs):
        panel -> op -> volume per rank, nested phases counted in their panel; a panel without calls is {}."""
        table = self.volume_by_phase_op(top_phase)
        return {panel: table.get(panel, {}) for panel in GRPO_PANELS}

    def phase_split(self) -> list[tuple[str, float, float, float]]:
        """(top-level phase, wall s, communication s not overlapped, compute s) on rank 0: all three
        times >= 0 and exposed <= wall by construction; inputs that disagree are `clock_problems`.

        Wall time comes from metrics.jsonl; without it, the phase is only what its calls took."""
        return self._phase_split_and_problems[0]

    def clock_problems(self) -> list[str]:
        """Where rank 0's times contradict each other (calls that end before they begin, a phase's
        calls blocking it longer than the phase lasted): the split shows them clipped."""
        return self._phase_split_and_problems[1]

    @cached_property
    def _phase_split_and_problems(self) -> tuple[list[tuple[str, float, float, float]], list[str]]:
        rank0 = [e for e in self.events if e["rank"] == self.ranks[0]] if self.ranks else []
        rows, problems = [], []
        reversed_ = reversed_calls(rank0)
        if reversed_:
            worst = max(arrival(e) - e["t_end"] for e in reversed_)
            problems.append(
                f"{len(reversed_)} calls of rank 0 end before they begin (by up to {worst * 1e6:.0f} us): "
                "counted as taking no time"
            )
        names = {top_phase(e["phase"]) for e in rank0} | set(self._top_level_walls())
        for name in sorted(names, key=self.phase_key):
            mine = [e for e in rank0 if top_phase(e["phase"]) == name]
            blocked_s = length([span(e) for e in mine]) * (1 - overlap_fraction(mine)) if mine else 0.0
            wall = self._top_level_walls().get(name, blocked_s)
            if blocked_s > wall * (1 + PHASE_CLOCK_TOLERANCE) + PHASE_CLOCK_SLACK_S:
                problems.append(
                    f"phase {name}: rank 0 blocked in communication {blocked_s:.6f} s, longer than the "
                    f"phase's {wall:.6f} s (phase and call clocks disagree): exposed shown as the wall"
                )
            exposed = min(blocked_s, wall)
            rows.append((name, wall, exposed, wall - exposed))
        return rows, problems

    def _top_level_walls(self) -> dict[str, float]:
        return {p: t for p, t in self.phase_wall.items() if "/" not in p}

    def held_up(self) -> dict[int, tuple[int, float]]:
        """rank -> (calls it was the straggler of, seconds the others waited for it: matching.held_up)."""
        return held_up(self.calls, min_wait_s=STRAGGLER_MIN_WAIT_S)

    def per_rank(self) -> list[tuple[int, float, float, int, float]]:
        """(rank, comm s, wait s, times it was the straggler, overlap fraction)."""
        waits, slow = wait_by_rank(self.calls), straggler_counts(self.calls, min_wait_s=STRAGGLER_MIN_WAIT_S)
        rows = []
        for rank in self.ranks:
            mine = [e for e in self.events if e["rank"] == rank]
            rows.append(
                (
                    rank,
                    sum(duration(e) for e in mine),
                    waits.get(rank, 0.0),
                    slow.get(rank, 0),
                    overlap_fraction(mine),
                )
            )
        return rows

    def imbalance(self) -> float:
        """max / mean of the ranks' communication seconds (1.0 = balanced)."""
        comm = [r[1] for r in self.per_rank()]
        mean = sum(comm) / len(comm) if comm else 0.0
        return max(comm) / mean if mean > 0 else 1.0

    def top_calls(self, k: int = 10) -> list[tuple]:
        """The k matched calls with the most time summed over ranks:
        (op, phase, step, bytes, ranks, seconds over ranks, transfer s, slow rank, its lead s)."""
        ranked = sorted(self.calls, key=lambda c: -sum(duration(e) for e in c.events.values()))[:k]
        return [
            (
                c.op,
                c.phase,
                c.step,
                c.bytes,
                len(c.group_ranks),
                sum(duration(e) for e in c.events.values()),
                c.transfer_s,
                c.slow_rank,
                max(c.wait(r) for r in c.events),
            )
            for c in ranked
        ]

    def message_sizes(self) -> list[int]:
        return [e["bytes"] for e in self.events if e["rank"] == self.ranks[0] and e["bytes"] > 0]

    def has_grpo_panels(self) -> bool:
        return any(top_phase(e["phase"]) in GRPO_PANELS for e in self.events)


def summarise_stage(stage_dir: Path) -> StageSummary:
    events = load_events(stage_dir)
    name, walls, metrics = Path(stage_dir).name, load_phase_times(stage_dir), load_metrics(stage_dir)
    return StageSummary(name, events, match_calls(events), walls, metrics)
