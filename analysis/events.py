"""Reading a run directory back: the communication events of each stage (profile/rank-*.jsonl) and
the per-step phase wall times (metrics.jsonl, keys "phase_time/<phase>")."""

from __future__ import annotations

import json
from pathlib import Path

PHASE_TIME_PREFIX = "phase_time/"


def read_jsonl(path: Path) -> list[dict]:
    """The file's rows; a last line without its newline is a write cut short by a kill and is left out."""
    text = path.read_text()
    complete = text if text.endswith("\n") else text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def stage_dirs(run_dir: Path) -> list[Path]:
    """Stages that left a profile; stage ids sort in pipeline order (stage1_..., stage2_...)."""
    return [
        d for d in sorted(Path(run_dir).iterdir()) if d.is_dir() and any((d / "profile").glob("rank-*.jsonl"))
    ]


def load_events(stage_dir: Path) -> list[dict]:
    """Every rank's events of one stage; a call never seen to complete gets t_end = t_start. A step
    that several attempts of the stage recorded (an attempt died, the next resumed from an earlier
    checkpoint and redid it) counts once: the last attempt's events of it are kept."""
    events = []
    for path in sorted((Path(stage_dir) / "profile").glob("rank-*.jsonl")):
        for e in read_jsonl(path):
            e["t_end"] = e["t_start"] if e["t_end"] is None else e["t_end"]
            e.setdefault("async_op", False)
            e.setdefault("t_wait", None)  # profiles written before the field existed
            e.setdefault("attempt", 1)
            e.setdefault("t_ready", None)
            e.setdefault("side_stream", None)
            events.append(e)
    last = {}
    for e in events:
        last[e["rank"], e["step"]] = max(last.get((e["rank"], e["step"]), 0), e["attempt"])
    return [e for e in events if e["attempt"] == last[e["rank"], e["step"]]]


def load_metrics(stage_dir: Path) -> list[dict]:
    """The stage's metrics.jsonl lines (rank 0's), [] when it logged none."""
    path = Path(stage_dir) / "metrics.jsonl"
    return read_jsonl(path) if path.exists() else []


def phase_times(row: dict) -> dict[str, float]:
    """One metrics line's phase wall seconds, in the line's order (the order the phases ended)."""
    return {
        k.removeprefix(PHASE_TIME_PREFIX): float(v) for k, v in row.items() if k.startswith(PHASE_TIME_PREFIX)
    }


def load_phase_times(stage_dir: Path) -> dict[str, float]:
    """Total wall seconds per phase over the stage's steps (rank 0's metrics), {} when not logged."""
    totals: dict[str, float] = {}
    for row in load_metrics(stage_dir):
        for name, seconds in phase_times(row).items():
            totals[name] = totals.get(name, 0.0) + seconds
    return totals


def arrival(event: dict) -> float:
    """When the rank got to the call: on CUDA when its stream reached it (t_ready; the host enqueues
    ahead of the GPU), elsewhere when it made the call."""
    return event["t_start"] if event.get("t_ready") is None else event["t_ready"]


def beside_caller(event: dict) -> bool:
    """Whether the call ran while its caller went on: asked for async (async_op), or put on a CUDA
    stream other than the device's default one, where compute runs (DeepSpeed's overlap_comm
    reduction stream, FSDP2's all-gather stream): the compute stream does not wait for it."""
    return bool(event["async_op"] or event.get("side_stream"))
