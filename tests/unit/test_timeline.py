"""report/timeline.json against the Trace Event Format (JSON Object Format): the fields each event type
requires, times in microseconds from the run's first call, a named process per stage and rank,
slices that nest on every thread, every recorded call exactly once, and a flow from the first rank to
reach a matched collective to the last. On a two-rank stage made by hand and on a cut of a real one
(tests/unit/fixtures/tiny-cpu-profile: steps 0-2 of the embedded default's SFT stage; setup, two
steps, a checkpoint step and the evaluation of its GRPO stage)."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from analysis.breakdown import summarise_stage
from analysis.events import load_events
from analysis.timeline import write_timeline
from runtime.comm_profiler import FIELDS

REAL_RUN = Path(__file__).parent / "fixtures" / "tiny-cpu-profile"
ORIGIN = 100.0  # the hand-made stage's first call
NUMBER = (int, float)
# The keys (and their types) each event type needs, per the format's document.
REQUIRED = {
    "X": {"name": str, "cat": str, "ts": NUMBER, "dur": NUMBER, "pid": int, "tid": int, "args": dict},
    "M": {"name": str, "pid": int, "tid": int, "args": dict},
    "s": {"name": str, "cat": str, "id": int, "ts": NUMBER, "pid": int, "tid": int},
    "f": {"name": str, "cat": str, "id": int, "ts": NUMBER, "pid": int, "tid": int, "bp": str},
}
METADATA = {"process_name": ("name", str), "thread_name": ("name", str)}
METADATA |= {"process_sort_index": ("sort_index", int), "thread_sort_index": ("sort_index", int)}


def call(rank, step, phase, op, seq, t0, t1, async_op=False, peer=None, group=(0, 1)) -> dict:
    e = {
        "stage": "stage1_sft",
        "step": step,
        "phase": phase,
        "rank": rank,
        "op": op,
        "bytes": 4096,
        "dtype": "float32",
        "group_size": len(group),
        "group_ranks": list(group),
        "peer": peer,
        "seq": seq,
        "t_start": ORIGIN + t0,
        "t_end": None if t1 is None else ORIGIN + t1,
        "backend": "gloo",
        "source": "torch.distributed",
        "async_op": async_op,
        "t_wait": None,
        "attempt": 1,
        "t_ready": None,
        "side_stream": None,
    }
    assert tuple(e) == FIELDS  # the profiler's schema, no more, no less
    return e


def hand_made_calls() -> list[dict]:
    """Rank 1 arrives 2 ms after rank 0 at every collective; times in seconds after ORIGIN."""
    both = [
        ("none", "broadcast", 0, 0.0, 0.010, False),  # setup, step 0
        ("forward", "all_reduce", 0, 1.0, 1.005, False),
        ("backward", "all_reduce", 1, 1.1, 1.3, True),  # DDP's bucket, in flight...
        ("backward", "all_reduce", 2, 1.15, 1.16, False),  # ...while a sync call runs
        ("backward", "all_reduce", 3, 1.2, 1.45, True),  # ...and the next, done after forward starts
        ("forward", "all_reduce", 4, 1.4, 1.41, False),  # gradient accumulation: forward again
        ("policy_update", "all_reduce", 5, 1.5, 1.51, False),
        ("policy_update/grad_sync", "all_reduce", 6, 1.52, 1.53, False),
        ("policy_update", "all_reduce", 7, 1.6, 1.61, False),
        ("policy_update", "barrier", 0, 1.8, 1.81, False),  # rank 1 never saw it complete
    ]
    events = []
    for phase, op, seq, t0, t1, async_op in both:
        step = 0 if phase == "none" else 1
        events.append(call(0, step, phase, op, seq, t0, t1, async_op))
        events.append(call(1, step, phase, op, seq, t0 + 0.002, None if op == "barrier" else t1, async_op))
    events.append(call(0, 1, "policy_update", "send", 0, 1.7, 1.71, peer=1))
    events.append(call(1, 1, "policy_update", "recv", 0, 1.7, 1.71, peer=0))
    return events


def write_stage(root: Path, events: list[dict]) -> Path:
    stage = root / "stage1_sft"
    (stage / "profile").mkdir(parents=True)
    for rank in (0, 1):
        lines = [json.dumps(e) + "\n" for e in events if e["rank"] == rank]
        (stage / "profile" / f"rank-{rank:05d}.jsonl").write_text("".join(lines))
    metrics = {"step": 1, "phase_time/forward": 0.1, "t_start": ORIGIN + 0.9, "step_time_s": 1.0}
    (stage / "metrics.jsonl").write_text(json.dumps(metrics) + "\n")
    return stage


def traced(stage_dirs: list[Path], out: Path) -> dict:
    stages = [summarise_stage(d) for d in stage_dirs]
    return json.loads(write_timeline(stages, "run", out / "timeline.json").read_text())


@pytest.fixture(scope="module")
def hand_made(tmp_path_factory) -> tuple[dict, list[Path]]:
    root = tmp_path_factory.mktemp("hand-made")
    dirs = [write_stage(root, hand_made_calls())]
    return traced(dirs, root), dirs


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> tuple[dict, list[Path]]:
    dirs = [REAL_RUN / "stage1_sft", REAL_RUN / "stage2_grpo"]
    return traced(dirs, tmp_path_factory.mktemp("real")), dirs


@pytest.fixture(params=["hand_made", "real"])
def trace(request) -> tuple[dict, list[Path]]:
    return request.getfixturevalue(request.param)


def of(trace: dict, ph: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == ph]


def names(trace: dict, kind: str) -> dict:
    """pid (process_name) or (pid, tid) (thread_name) -> the name the metadata gives it."""
    return {
        (e["pid"] if kind == "process_name" else (e["pid"], e["tid"])): e["args"]["name"]
        for e in of(trace, "M")
        if e["name"] == kind
    }


def ns(ts: float) -> int:
    return round(ts * 1000)


def inside(point: dict, x: dict) -> bool:
    """The point lies inside the slice, off its edges (at its start only if it lasts no time)."""
    start, end, at = ns(x["ts"]), ns(x["ts"] + x["dur"]), ns(point["ts"])
    return start < at < end or start == at == end


def test_the_file_is_the_json_object_format(trace):
    doc, _ = trace
    assert isinstance(doc["traceEvents"], list) and doc["traceEvents"]
    assert doc["displayTimeUnit"] in ("ms", "ns")


def test_every_event_has_the_fields_its_type_requires_with_their_types(trace):
    doc, _ = trace
    for e in doc["traceEvents"]:
        assert e["ph"] in REQUIRED, e
        for key, kind in REQUIRED[e["ph"]].items():
            # bool is an int to isinstance: a True pid would pass
            assert isinstance(e[key], kind) and not isinstance(e[key], bool), (key, e)
        if "ts" in e:
            assert e["ts"] >= 0 and e.get("dur", 0) >= 0, e
        if e["ph"] == "M":
            key, kind = METADATA[e["name"]]
            assert isinstance(e["args"][key], kind), e
        if e["ph"] == "f":
            assert e["bp"] == "e", e  # bound to the slice it lands in, not the next one


def test_times_are_microseconds_from_the_runs_first_call(hand_made):
    doc, _ = hand_made
    slices = of(doc, "X")
    assert min(e["ts"] for e in slices) == 0
    # rank 0's first forward all-reduce: 1 s after the first call, 5 ms long
    forward = next(
        e for e in slices if e["cat"] == "comm" and e["args"]["seq"] == 0 and e["name"] == "all_reduce"
    )
    assert forward["ts"] == pytest.approx(1_000_000, abs=1e-3) and forward["dur"] == pytest.approx(
        5_000, abs=1e-3
    )


def test_each_stage_and_rank_is_a_process_named_by_metadata_and_each_thread_too(trace):
    doc, dirs = trace
    processes, threads = names(doc, "process_name"), names(doc, "thread_name")
    expected = {f"{d.name}: rank {r}" for d in dirs for r in {e["rank"] for e in load_events(d)}}
    assert sorted(processes.values()) == sorted(expected)
    for e in of(doc, "X") + of(doc, "s") + of(doc, "f"):
        assert e["pid"] in processes and (e["pid"], e["tid"]) in threads, e


def test_slices_of_one_thread_nest(trace):
    doc, _ = trace
    by_thread = defaultdict(list)
    for e in of(doc, "X"):
        by_thread[e["pid"], e["tid"]].append((ns(e["ts"]), ns(e["ts"]) + ns(e["dur"])))
    for thread, spans in by_thread.items():
        open_ends: list[int] = []
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1], (thread, start, end, open_ends)
            open_ends.append(end)


def test_every_recorded_call_is_one_slice_named_by_its_op_with_its_fields(trace):
    doc, dirs = trace
    processes = names(doc, "process_name")
    keys = ("op", "seq", "step", "phase", "bytes", "async_op", "source")
    drawn = Counter(
        (processes[e["pid"]], e["name"], *(e["args"][k] for k in keys[1:]), tuple(e["args"]["group_ranks"]))
        for e in of(doc, "X")
        if e["cat"] == "comm"
    )
    recorded = Counter(
        (f"{d.name}: rank {e['rank']}", *(e[k] for k in keys), tuple(e["group_ranks"]))
        for d in dirs
        for e in load_events(d)
    )
    assert drawn == recorded and max(drawn.values()) == 1


def test_each_matched_collective_has_a_flow_from_the_first_rank_to_arrive_to_the_last(trace):
    doc, dirs = trace
    points = defaultdict(dict)
    for e in of(doc, "s") + of(doc, "f"):
        assert e["ph"] not in points[e["id"]], e  # one start and one finish per id
        points[e["id"]][e["ph"]] = e
    comm = defaultdict(list)
    for e in of(doc, "X"):
        if e["cat"] == "comm":
            comm[e["pid"], e["tid"]].append(e)
    for flow in points.values():
        start, finish = flow["s"], flow["f"]
        assert (start["cat"], start["name"]) == (finish["cat"], finish["name"])
        assert start["ts"] <= finish["ts"] and start["pid"] != finish["pid"]
        for point in (start, finish):  # bound to a call's slice: inside one on its thread
            assert any(inside(point, x) for x in comm[point["pid"], point["tid"]]), point
    expected = 0
    for d in dirs:
        for c in summarise_stage(d).calls:
            arrivals = sorted((e["t_start"], r) for r, e in c.events.items())
            expected += arrivals[0][0] < arrivals[-1][0]
    assert len(points) == expected > 0


def test_the_hand_made_stages_flows_point_from_rank_0_to_the_late_rank_1(hand_made):
    doc, _ = hand_made
    processes = names(doc, "process_name")
    flows = [(processes[e["pid"]], e["ph"]) for e in of(doc, "s") + of(doc, "f")]
    # 10 matched collectives (send/recv are not), rank 1 late at each
    assert Counter(flows) == {("stage1_sft: rank 0", "s"): 10, ("stage1_sft: rank 1", "f"): 10}


def test_phases_nest_in_steps_and_a_phase_entered_twice_is_two_ranges(hand_made):
    doc, _ = hand_made
    threads = names(doc, "thread_name")
    rank0 = next(pid for pid, name in names(doc, "process_name").items() if name.endswith("rank 0"))
    phases = [e for e in of(doc, "X") if threads[e["pid"], e["tid"]] == "phases" and e["pid"] == rank0]
    assert [e["name"] for e in sorted(phases, key=lambda e: (e["ts"], -e["dur"]))] == [
        "step 0",
        "none",
        "step 1",
        "forward",
        "backward",
        "forward",
        "policy_update",
        "grad_sync",
    ]
    span = {}  # name -> (start, end) in seconds, of the name's first range
    for e in phases:
        span.setdefault(e["name"], (e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6))
    assert span["step 1"] == pytest.approx((1.0, 1.81)) and span["forward"] == pytest.approx((1.0, 1.005))
    # to the end of its last blocking call; an async call shows the rank there only at its start:
    # the bucket still in flight when forward starts again does not stretch it
    assert span["backward"] == pytest.approx((1.1, 1.2))
    assert span["policy_update"] == pytest.approx((1.5, 1.81)) and span["grad_sync"] == pytest.approx(
        (1.52, 1.53)
    )


def test_overlapping_calls_go_on_threads_of_their_own(hand_made):
    doc, _ = hand_made
    threads = names(doc, "thread_name")
    rank0 = next(pid for pid, name in names(doc, "process_name").items() if name.endswith("rank 0"))
    lane = {
        e["args"]["seq"]: threads[e["pid"], e["tid"]]
        for e in of(doc, "X")
        if e["pid"] == rank0 and e["name"] == "all_reduce"
    }
    assert lane[1] == "async collectives" and lane[3] == "async collectives 2"
    assert lane[2] == lane[4] == "collectives"


def test_metrics_steps_are_drawn_on_the_first_rank(hand_made):
    doc, _ = hand_made
    threads = names(doc, "thread_name")
    steps = [e for e in of(doc, "X") if threads[e["pid"], e["tid"]] == "steps (metrics.jsonl)"]
    assert len(steps) == 1 and names(doc, "process_name")[steps[0]["pid"]] == "stage1_sft: rank 0"
    assert steps[0]["ts"] == pytest.approx(900_000, abs=1e-3) and steps[0]["dur"] == pytest.approx(
        1e6, abs=1e-3
    )
