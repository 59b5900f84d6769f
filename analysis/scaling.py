"""Weak scaling across run directories of different sizes (the scales of an `hpcr1 sweep`): per
stage, throughput, scaling efficiency and the share of step time spent communicating, against the
GPU (rank) count, as a table, a JSON file and one figure per stage.

- Measured steps: every step but the first (its time includes one-off work: allocations, lazily
  built communicators), or the only one of a one-step run. Setup before step 1 (the model's
  broadcast), checkpoints and the evaluation after the last step fall outside every step.
- Throughput: samples (SFT sequences, GRPO responses) and, for SFT, tokens over the measured steps,
  divided by their summed step_time_s, from rank 0's metrics.jsonl. Synthesis: answers sampled over
  the slowest rank's generation time.
- Efficiency (weak scaling): samples/s per GPU at N over samples/s per GPU at the smallest N.
- Communication fraction: on each rank, the seconds it was blocked in communication inside the
  measured steps' windows [t_start, t_start + step_time_s], over their summed step time, averaged
  over ranks. Blocked means inside a synchronous call, or waiting for an async one
  (analysis/overlap.py): async calls overlapped with compute do not count. A call over a group of
  one rank moves nothing and is not counted. The windows are rank 0's wall clock, like the events'
  times; across nodes they are as good as the clocks' synchronisation. Not measured for synthesis
  (one long step) nor where the run did not profile (`profile.comm: false`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from analysis import figures
from analysis.events import load_events, read_jsonl
from analysis.overlap import Interval, blocked, intersection
from analysis.tables import Table, elapsed

SWEEP_FILE = "sweep.json"  # written by pipeline/sweep.py


@dataclass
class ScalePoint:
    """One stage of one run."""

    gpus: int
    run: str
    measured_steps: int
    step_s: float
    samples_per_s: float
    tokens_per_s: float | None
    comm_fraction: float | None
    efficiency: float = 1.0

    @property
    def per_gpu(self) -> float:
        return self.samples_per_s / self.gpus


def sweep_run_dirs(root: Path) -> list[Path]:
    """The run directories a sweep lists, smallest scale first."""
    record = json.loads((Path(root) / SWEEP_FILE).read_text())
    return [Path(root) / s["run_dir"] for s in sorted(record["scales"], key=lambda s: s["gpus"])]


def is_scaling_set(run_dirs: list[Path]) -> bool:
    """Runs (directories with a config.yaml) of more than one size: worth a scaling section."""
    return len({run_config(r)["nproc"] for r in run_dirs if (Path(r) / "config.yaml").is_file()}) > 1


def run_config(run_dir: Path) -> dict:
    return yaml.safe_load((Path(run_dir) / "config.yaml").read_text())


def scaling(run_dirs: list[Path], labels: list[str]) -> tuple[dict[str, list[ScalePoint]], list[str]]:
    """stage -> its points, smallest GPU count first, efficiency relative to the first; and the
    stages left out because their metrics.jsonl has no throughput (written before it was logged)."""
    stages: dict[str, list[ScalePoint]] = {}
    left_out = []
    for run_dir, label in zip(run_dirs, labels):
        if not (Path(run_dir) / "config.yaml").is_file():
            continue  # not a run directory the pipeline wrote
        cfg = run_config(run_dir)
        for metrics in sorted(Path(run_dir).glob("*/metrics.jsonl")):
            point = stage_point(metrics.parent, label, cfg["nproc"], cfg["profile"]["comm"])
            if point is None:
                left_out.append(f"{label}/{metrics.parent.name}")
            else:
                stages.setdefault(metrics.parent.name, []).append(point)
    for points in stages.values():
        points.sort(key=lambda p: p.gpus)
        for p in points:
            p.efficiency = p.per_gpu / points[0].per_gpu
    return stages, left_out


def stage_point(stage_dir: Path, run: str, gpus: int, profiled: bool) -> ScalePoint | None:
    rows = read_jsonl(stage_dir / "metrics.jsonl")
    if rows and "generation_time_s_per_rank" in rows[0]:  # synthesis: one summary line
        slowest = max(rows[0]["generation_time_s_per_rank"])
        return ScalePoint(gpus, run, 1, slowest, rows[0]["sampled"] / slowest, None, None)
    if not rows or "samples_per_s" not in rows[0]:
        return None
    steps = rows[1:] or rows
    seconds = sum(r["step_time_s"] for r in steps)
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in steps) if "tokens_per_s" in steps[0] else None
    windows = [(r["t_start"], r["t_start"] + r["step_time_s"]) for r in steps if "t_start" in r]
    comm = comm_fraction(stage_dir, windows, gpus) if profiled and len(windows) == len(steps) else None
    return ScalePoint(
        gpus,
        run,
        len(steps),
        seconds / len(steps),
        sum(r["samples_per_s"] * r["step_time_s"] for r in steps) / seconds,
        None if tokens is None else tokens / seconds,
        comm,
    )


def comm_fraction(stage_dir: Path, windows: list[Interval], gpus: int) -> float | None:
    """Mean over ranks of blocked communication seconds inside `windows` over their length."""
    by_rank: dict[int, list[dict]] = {}
    for e in load_events(stage_dir):
        if e["group_size"] > 1:
            by_rank.setdefault(e["rank"], []).append(e)
    files = len(list((Path(stage_dir) / "profile").glob("rank-*.jsonl")))
    if gpus > 1 and files < gpus:
        return None  # a rank's profile is missing: the fraction would read low
    total = sum(end - start for start, end in windows)
    return sum(intersection(blocked(events), windows) for events in by_rank.values()) / total / gpus


def scaling_tables(stages: dict[str, list[ScalePoint]]) -> list[Table]:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.1%}"

    return [
        Table(
            f"Weak scaling: {stage}",
            [
                "GPUs",
                "run",
                "steps measured",
                "step time",
                "samples/s",
                "tokens/s",
                "samples/s per GPU",
                "efficiency",
                "comm fraction",
            ],
            [
                [
                    str(p.gpus),
                    p.run,
                    str(p.measured_steps),
                    elapsed(p.step_s),
                    f"{p.samples_per_s:.2f}",
                    "-" if p.tokens_per_s is None else f"{p.tokens_per_s:.1f}",
                    f"{p.per_gpu:.2f}",
                    f"{p.efficiency:.3f}",
                    pct(p.comm_fraction),
                ]
                for p in points
            ],
        )
        for stage, points in stages.items()
    ]


def write_scaling_json(stages: dict[str, list[ScalePoint]], path: Path) -> Path:
    path.write_text(
        json.dumps({stage: [asdict(p) for p in points] for stage, points in stages.items()}, indent=2)
    )
    return path


def scaling_figure(stage: str, points: list[ScalePoint], path: Path) -> Path:
    """Three panels against GPU count: throughput with the ideal line, efficiency, comm fraction."""
    gpus = [p.gpus for p in points]
    fig, (thr, eff, comm) = figures.plt.subplots(1, 3, figsize=(12, 3.6))
    thr.plot(gpus, [p.samples_per_s for p in points], "o-", label="measured")
    thr.plot(gpus, [points[0].per_gpu * n for n in gpus], "--", color="grey", label="ideal (linear)")
    label_points(thr, gpus, [p.samples_per_s for p in points], "{:.3g}")
    thr.set_ylim(0, max(points[0].per_gpu * gpus[-1], *(p.samples_per_s for p in points)) * 1.15)
    thr.set_ylabel("samples/s, all GPUs together")
    thr.legend(fontsize=8, loc="upper left")
    thr.set_title("throughput")
    eff.plot(gpus, [p.efficiency * 100 for p in points], "o-")
    eff.axhline(100, linestyle="--", color="grey")
    eff.set_ylim(0, max(110, *(p.efficiency * 110 for p in points)))
    eff.set_ylabel(f"% of per-GPU throughput at {gpus[0]} GPU{'s' if gpus[0] > 1 else ''}")
    eff.set_title("weak-scaling efficiency")
    measured = [p for p in points if p.comm_fraction is not None]
    comm.plot([p.gpus for p in measured], [p.comm_fraction * 100 for p in measured], "o-", color="C3")
    comm.set_ylim(0, 100)
    comm.set_ylabel("% of step time blocked in communication")
    comm.set_title("communication fraction" + ("" if measured else " (not measured)"))
    label_points(eff, gpus, [p.efficiency * 100 for p in points], "{:.0f}%")
    label_points(comm, [p.gpus for p in measured], [p.comm_fraction * 100 for p in measured], "{:.0f}%")
    for ax in (thr, eff, comm):
        ax.set_xscale("log", base=2)
        ax.set_xticks(gpus, [str(n) for n in gpus])
        ax.minorticks_off()
        ax.set_xlabel("GPUs (ranks)")
    fig.suptitle(f"{stage}: weak scaling (batch per GPU fixed)")
    return figures.save(fig, path)


def label_points(ax, xs: list[int], ys: list[float], fmt: str) -> None:
    for x, y in zip(xs, ys):
        ax.annotate(fmt.format(y), (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
