"""report/timeline.json: a run's communication on one time axis, as a Chrome trace (the Trace Event
Format's JSON Object Format, {"traceEvents": [...], "displayTimeUnit": "ms"}), for Perfetto's UI or
chrome://tracing, where the tables' sums can be looked at call by call.

Processes: one per stage and rank, named "<stage>: rank N", in pipeline order, then by rank. Not one
per rank across the stages: each stage is its own set of processes, with its own world size, and
under Slurm two stages may run at once, so a rank's tracks would overlap; Perfetto keeps a process's
tracks together, and a stage's processes sort next to each other.

Threads of a process:
- "phases": the rank's steps and, nested in them, its phases (policy_update, then policy_update/x
  inside it), drawn from its calls, not from metrics.jsonl, which has each phase's total per step
  but not when it ran: a range spans a run of consecutive calls of the same step and phase, from the
  first call's start to the end of its last blocking call, never past the next run's first call. A
  phase entered twice in a step (gradient accumulation's forward/backward) is two ranges. A range
  shows when the phase communicated, not all of its wall time: compute before its first call or after
  its last is outside it, and a phase that made no call (rollout) is a gap.
- "steps (metrics.jsonl)", on the first rank only: each step's whole wall time, from metrics.jsonl's
  t_start and step_time_s (rank 0 writes it), where a stage logs them.
- "generation (metrics.jsonl)", on the first rank only, where the rollout has ranks of its own:
  the sampling of each step's batch, from its first batch's start (rollout/generated_at) for a
  generator's seconds on them (rollout/generation_s). With max_staleness k the batch of step s + k
  is sampled while step s trains: the two tracks show the overlap.
- "collectives": each recorded call a complete ("X") slice named by its op. Slices of one thread
  must nest, so calls that overlap (async calls in flight, a call from another thread) go on more
  threads: "collectives 2", ..., and async calls on "async collectives", ... of their own.
Flows: for each call matched across ranks (analysis/matching.py), an arrow from the first rank to
arrive to the last, the one the others waited for. Each end sits 1 µs into its call's slice (halfway
into a shorter one; "f" with bp "e", bound to the enclosing slice): inside the slice rather than on
its edge, where a viewer may sort it before the slice opens and bind it to nothing.

Times: ts and dur in microseconds from the run's earliest call or logged step start
(otherData.time_origin_unix_s), computed in whole nanoseconds, so that slices that nest in the data
still nest after rounding.
Size: about two trace events per call; a stage of more than LARGE_STAGE calls is kept whole (the
report says so) rather than sampled, since a sample would hide the calls one looks for.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import groupby
from pathlib import Path

from analysis.breakdown import StageSummary
from analysis.events import arrival, beside_caller

LARGE_STAGE = 200_000  # calls; the embedded default's five stages record about 20,000
PHASES_TID, STEPS_TID, GENERATION_TID = 1, 2, 3  # then the collectives' threads
FLOW_OFFSET_NS = 1000


def nanoseconds(t: float, origin: float) -> int:
    return round((t - origin) * 1e9)


def complete(name: str, cat: str, track: tuple[int, int], start_ns: int, end_ns: int, args: dict) -> dict:
    pid, tid = track
    ts, dur = start_ns / 1000, (end_ns - start_ns) / 1000
    return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": pid, "tid": tid, "args": args}


def metadata(kind: str, pid: int, tid: int, args: dict) -> dict:
    """A process_name, process_sort_index, thread_name or thread_sort_index event."""
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


def run_key(e: dict, depth: int) -> int | str | None:
    """What a range at `depth` groups by: the step (depth 0), else the phase's first `depth` parts;
    None for a call made in the parent phase itself."""
    if depth == 0:
        return e["step"]
    parts = e["phase"].split("/")
    return "/".join(parts[:depth]) if len(parts) >= depth else None


def call_end(e: dict) -> float:
    return max(e["t_start"], e["t_end"])  # a clock stepped back mid-call must not give a negative dur


def blocked_until(e: dict) -> float:
    """Until when a call shows its rank in its phase: its end if it blocked the rank, else its start."""
    return e["t_start"] if beside_caller(e) else call_end(e)


def phase_ranges(events: list[dict], depth: int, hi: float) -> Iterator[tuple[int, int | str, float, float]]:
    """(depth, key, start, end) of the runs of consecutive calls (sorted by start) with one key, and
    recursively of the runs inside them. A range ends at its last call's start, or end if the call
    blocked the rank, and never after `hi` (its parent's end) nor the next run's first call, so that
    ranges of one depth never overlap and each lies inside its parent."""
    runs = [(key, list(calls)) for key, calls in groupby(events, key=lambda e: run_key(e, depth))]
    for i, (key, calls) in enumerate(runs):
        following = runs[i + 1][1][0]["t_start"] if i + 1 < len(runs) else hi
        start = calls[0]["t_start"]
        end = min(max(map(blocked_until, calls)), following, hi)
        if key is not None:
            yield depth, key, start, end
            yield from phase_ranges(calls, depth + 1, end)


def phase_slices(events: list[dict], pid: int, origin: float) -> list[dict]:
    """The "phases" thread of one rank: its steps, with its phases nested in them."""
    slices = []
    for depth, key, start, end in phase_ranges(events, 0, float("inf")):
        if depth == 0:
            name, cat, args = f"step {key}", "step", {"step": key}
        else:
            name, cat, args = str(key).rsplit("/", 1)[-1], "phase", {"phase": key}
        span = (nanoseconds(start, origin), nanoseconds(end, origin))
        slices.append(complete(name, cat, (pid, PHASES_TID), *span, args))
    return slices


def lanes(spans: list[tuple[int, int]]) -> list[int]:
    """A lane for each (start, end), spans sorted by start: the first lane free by its start, so that
    no two spans of a lane overlap."""
    ends: list[int] = []
    chosen = []
    for start, end in spans:
        lane = next((i for i, last in enumerate(ends) if last <= start), len(ends))
        if lane == len(ends):
            ends.append(end)
        else:
            ends[lane] = end
        chosen.append(lane)
    return chosen


def logged_steps(s: StageSummary) -> list[tuple[int, float, float]]:
    """(step, start, end) of each step metrics.jsonl times, by start."""
    rows = [row for row in s.metrics if "t_start" in row and "step_time_s" in row]
    return sorted(
        ((row["step"], row["t_start"], row["t_start"] + row["step_time_s"]) for row in rows),
        key=lambda r: r[1],
    )


def logged_generation(s: StageSummary) -> list[tuple[int, float, float]]:
    """(step, start, end) of the sampling of each step's batch, where the rollout has its own ranks."""
    rows = [row for row in s.metrics if "rollout/generated_at" in row]
    return sorted(
        (row["step"], start := row["rollout/generated_at"], start + row["rollout/generation_s"])
        for row in rows
    )


def step_spans(steps: list[tuple[int, float, float]], origin: float) -> list[tuple[int, int, int]]:
    """(step, start ns, end ns), each ended by the next step's start at the latest: a step redone by
    a later attempt is logged twice, and slices of one thread must not overlap."""
    following = [start for _, start, _ in steps[1:]] + [float("inf")]
    return [
        (step, nanoseconds(start, origin), nanoseconds(max(start, min(end, after)), origin))
        for (step, start, end), after in zip(steps, following)
    ]


def call_args(e: dict) -> dict:
    args = {
        k: e.get(k) for k in ("bytes", "group_ranks", "async_op", "seq", "phase", "step", "source", "dtype")
    }
    if e.get("peer") is not None:
        args["peer"] = e["peer"]
    return {**args, "attempt": e["attempt"]}


class RankTrack:
    """One (stage, rank) process: its metadata, phase ranges, steps and collective slices; remembers
    where each call's slice went, for the flows."""

    def __init__(
        self, pid: int, name: str, events: list[dict], steps: list[tuple], origin: float, generation=()
    ):
        self.pid, self.trace = pid, [metadata("process_name", pid, 0, {"name": name})]
        self.trace.append(metadata("process_sort_index", pid, 0, {"sort_index": pid}))
        self.thread(PHASES_TID, "phases")
        self.trace += phase_slices(events, pid, origin)
        if steps:
            self.thread(STEPS_TID, "steps (metrics.jsonl)")
            self.trace += [
                complete(f"step {step}", "step", (pid, STEPS_TID), *span, {"step": step})
                for step, *span in step_spans(steps, origin)
            ]
        if generation:
            self.thread(GENERATION_TID, "generation (metrics.jsonl)")
            self.trace += [
                complete(
                    f"generation of step {step}", "generation", (pid, GENERATION_TID), *span, {"step": step}
                )
                for step, *span in step_spans(generation, origin)
            ]
        self.where: dict[int, tuple[int, int, int]] = {}  # id(event) -> (tid, start ns, end ns)
        tid = GENERATION_TID + 1
        for kind, is_async in (("collectives", False), ("async collectives", True)):
            tid = self.collectives([e for e in events if beside_caller(e) == is_async], kind, tid, origin)

    def thread(self, tid: int, name: str) -> None:
        self.trace += [
            metadata("thread_name", self.pid, tid, {"name": name}),
            metadata("thread_sort_index", self.pid, tid, {"sort_index": tid}),
        ]

    def collectives(self, events: list[dict], kind: str, first_tid: int, origin: float) -> int:
        """Slices of `events` on threads first_tid, first_tid + 1, ...; returns the next free tid."""
        spans = [(nanoseconds(e["t_start"], origin), nanoseconds(call_end(e), origin)) for e in events]
        chosen = lanes(spans)
        for lane in sorted(set(chosen)):
            self.thread(first_tid + lane, kind if lane == 0 else f"{kind} {lane + 1}")
        for e, (start, end), lane in zip(events, spans, chosen):
            self.trace.append(
                complete(e["op"], "comm", (self.pid, first_tid + lane), start, end, call_args(e))
            )
            self.where[id(e)] = (first_tid + lane, start, end)
        return first_tid + len(set(chosen))


def flow_point(ph: str, flow_id: int, name: str, pid: int, slot: tuple[int, int, int]) -> dict:
    tid, start, end = slot
    event = {"name": name, "cat": "wait", "ph": ph, "id": flow_id, "pid": pid, "tid": tid}
    event["ts"] = (start + min(FLOW_OFFSET_NS, (end - start) // 2)) / 1000
    return {**event, "bp": "e"} if ph == "f" else event


def flows(s: StageSummary, tracks: dict[int, RankTrack], first_id: int) -> list[dict]:
    """An arrow per matched call from its first rank to arrive to its last; ids from first_id on."""
    out = []
    for call in s.calls:
        first = min(call.events, key=lambda r: arrival(call.events[r]))
        last = call.slow_rank
        if first == last:
            continue  # all arrived at once
        flow_id, name = first_id + len(out) // 2, f"{call.op} wait"
        for ph, rank in (("s", first), ("f", last)):
            out.append(
                flow_point(ph, flow_id, name, tracks[rank].pid, tracks[rank].where[id(call.events[rank])])
            )
    return out


def timeline(stages: list[StageSummary], run: str) -> dict:
    """The trace of a run's stages (pipeline order) as the JSON Object Format's dict."""
    origin = min(
        [e["t_start"] for s in stages for e in s.events]
        + [t for s in stages for _, t, _ in logged_steps(s) + logged_generation(s)],
        default=0.0,
    )
    trace, pid, next_flow = [], 1, 1
    for s in stages:
        tracks = {}
        for rank in s.ranks:
            mine = sorted((e for e in s.events if e["rank"] == rank), key=lambda e: e["t_start"])
            first = rank == s.ranks[0]
            steps, generation = (logged_steps(s), logged_generation(s)) if first else ([], [])
            tracks[rank] = RankTrack(pid, f"{s.name}: rank {rank}", mine, steps, origin, generation)
            trace += tracks[rank].trace
            pid += 1
        arrows = flows(s, tracks, next_flow)
        trace += arrows
        next_flow += len(arrows) // 2
    return {
        "traceEvents": trace,
        "displayTimeUnit": "ms",
        "otherData": {
            "run": run,
            "time_origin_unix_s": origin,
            "calls_per_stage": {s.name: len(s.events) for s in stages},
        },
    }


def large_stages(stages: list[StageSummary]) -> list[str]:
    return [s.name for s in stages if len(s.events) > LARGE_STAGE]


def write_timeline(stages: list[StageSummary], run: str, path: Path) -> Path:
    """One trace event a line, so that the file can be read and grepped as well as loaded."""
    trace = timeline(stages, run)
    events = ",\n".join(json.dumps(e, separators=(",", ":")) for e in trace.pop("traceEvents"))
    rest = json.dumps(trace)[1:-1]
    path.write_text(f'{{"traceEvents":[\n{events}\n],\n{rest}}}\n')
    return path
