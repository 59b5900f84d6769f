"""The report's tables, built once and rendered both as Markdown and as HTML, so the two reports
hold the same numbers."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

from analysis.breakdown import StageSummary, Volume, top_phase


@dataclass
class Table:
    title: str
    header: list[str]
    rows: list[list[str]]

    def markdown(self) -> str:
        lines = [
            f"#### {self.title}",
            "",
            "| " + " | ".join(self.header) + " |",
            "|" + "|".join("---" for _ in self.header) + "|",
        ]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines) + "\n"

    def text(self) -> str:
        """The title, then columns aligned for a terminal."""
        widths = [max(len(row[i]) for row in [self.header, *self.rows]) for i in range(len(self.header))]
        line = lambda row: "  ".join(cell.rjust(w) for cell, w in zip(row, widths)).rstrip()  # noqa: E731
        return "\n".join([self.title, line(self.header), *map(line, self.rows)]) + "\n"

    def html(self) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in self.header)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in self.rows
        )
        return (
            f"<h4>{html.escape(self.title)}</h4>\n"
            f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>\n"
        )


def size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return ""


def significant(x: float, digits: int = 4) -> str:
    """x with `digits` significant digits, trailing zeros kept so that a column's cells line up."""
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x)))) if x else 0
    return f"{x:.{decimals}f}"


def scaled(value: float, units: tuple[tuple[float, str], ...]) -> str:
    """value in the largest unit (scale, name) it reaches, largest first; the last unit takes the rest.
    Rounded to 4 significant digits first, so that 999.96 ms reads 1.000 s, not 1000 ms."""
    value = float(f"{value:.4g}")
    scale, unit = next(((s, u) for s, u in units if abs(value) >= s), units[-1])
    return f"{significant(value / scale)} {unit}"


TIME_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"))
# Decimal, as nccl-tests and commbench report bus bandwidth (GB/s = 1e9 bytes a second).
RATE_UNITS = ((1e9, "GB/s"), (1e6, "MB/s"), (1e3, "KB/s"), (1.0, "B/s"))


def elapsed(seconds: float) -> str:
    """A duration with its unit, the one that fits: 102.2 s, 16.88 ms, 952.3 µs; 0 for none. Every
    time in the report's tables goes through here, so that no column has to say its unit."""
    return scaled(seconds, TIME_UNITS) if seconds else "0"


def rate(bytes_per_s: float) -> str:
    """A bandwidth in the unit that fits (GB/s down to B/s); "-" when nothing was measured."""
    return scaled(bytes_per_s, RATE_UNITS) if bytes_per_s else "-"


def stage_tables(s: StageSummary) -> list[Table]:
    phase_ops = s.volume_by_phase_op()
    ops = sorted({op for per in phase_ops.values() for op in per})

    def by_phase(title: str, cell) -> Table:
        return Table(
            title,
            ["phase", *ops],
            [
                [p, *(cell(phase_ops[p].get(op, Volume())) for op in ops)]
                for p in sorted(phase_ops, key=s.phase_key)
            ],
        )

    tables = [
        Table(
            "Time by phase (rank 0): compute and exposed communication",
            ["phase", "wall", "exposed comm", "compute"],
            [[p, elapsed(w), elapsed(c), elapsed(k)] for p, w, c, k in s.phase_split()],
        ),
        Table(
            "Communication by operation (per rank)",
            ["op", "calls", "bytes", "time", "median busbw"],
            [[op, str(n), size(b), elapsed(t), rate(bw)] for op, n, b, t, bw in s.by_op()],
        ),
        Table(
            "Communication by source, backend and operation (per rank)",
            ["source", "backend", "op", "calls", "bytes", "time"],
            [[src, backend, op, str(n), size(b), elapsed(t)] for src, backend, op, n, b, t in s.by_origin()],
        ),
        by_phase("Communication time by phase and operation (per rank)", lambda v: elapsed(v.seconds)),
        by_phase("Communication bytes by phase and operation (per rank)", lambda v: size(v.bytes)),
        Table(
            "Per rank: communication, waiting for stragglers, overlap",
            ["rank", "comm", "wait", "times slowest", "overlap"],
            [[str(r), elapsed(c), elapsed(w), str(n), f"{o:.0%}"] for r, c, w, n, o in s.per_rank()],
        ),
        Table(
            "Costliest calls",
            [
                "op",
                "phase",
                "step",
                "bytes",
                "ranks",
                "time over ranks",
                "transfer",
                "slowest rank",
                "others waited",
            ],
            [
                [op, ph, str(st), size(b), str(n), elapsed(t), elapsed(tr), str(slow), elapsed(w)]
                for op, ph, st, b, n, t, tr, slow, w in s.top_calls()
            ],
        ),
    ]
    if s.has_grpo_panels():
        tables.insert(1, grpo_panel_table(s))
    if any(GENERATION_S in row for row in s.metrics):
        tables.insert(1, split_table(s))
    return tables


GENERATION_S = "rollout/generation_s"  # a GRPO stage whose rollout has ranks of its own logs it


def split_table(s: StageSummary) -> Table:
    """A GRPO stage with generators of its own (stages/grpo/split.py): each side's seconds a step,
    means over the steps, and what running them side by side saved against one after the other."""
    rows = [row for row in s.metrics if GENERATION_S in row]
    mean = lambda key: sum(row.get(key, 0.0) for row in rows) / len(rows)  # noqa: E731
    step, sync, wait = mean("step_time_s"), mean("phase_time/weight_sync"), mean("phase_time/rollout_wait")
    generating, learning = mean(GENERATION_S), step - sync - wait
    handed = [e for e in s.step_events() if e["rank"] == 0 and top_phase(e["phase"]) == "weight_sync"]
    syncs = len({e["step"] for e in handed})
    per_sync = sum(e["bytes"] for e in handed) / syncs if syncs else 0
    return Table(
        f"Generation on ranks of its own: seconds a step (mean of {len(rows)}; staleness "
        f"{rows[-1].get('rollout/staleness', 0):.0f})",
        ["side", "what", "time a step"],
        [
            ["trainers", f"weight hand-over ({size(per_sync)} a sync, {syncs} syncs)", elapsed(sync)],
            ["trainers", "waiting for a batch (rollout_wait)", elapsed(wait)],
            ["trainers", "learning (reward to policy_update)", elapsed(learning)],
            ["generators", "sampling and sending a batch", elapsed(generating)],
            ["generators", "idle (step - hand-over - sampling)", elapsed(max(step - sync - generating, 0.0))],
            ["both", "step", elapsed(step)],
            ["both", "saved against one side after the other", elapsed(generating + learning + sync - step)],
        ],
    )


def grpo_panel_table(s: StageSummary) -> Table:
    """The three GRPO phases side by side, the numbers of the three-panel figure."""
    panels = s.grpo_panels()
    ops = sorted({op for per in panels.values() for op in per})
    header = ["op", *(f"{panel} {unit}" for panel in panels for unit in ("calls", "bytes", "time"))]
    rows = [
        [op, *(cell for per in panels.values() for cell in volume_cells(per.get(op, Volume())))] for op in ops
    ]
    return Table("GRPO phases side by side: communication per rank over the stage", header, rows)


def volume_cells(v: Volume) -> list[str]:
    return [f"{v.calls:g}", size(v.bytes), elapsed(v.seconds)]


def cross_stage_table(stages: list[StageSummary]) -> Table:
    rows = []
    for s in stages:
        top = s.by_op()[0][0] if s.events else "-"
        rows.append(
            [
                s.name,
                str(len(s.ranks)),
                str(s.steps),
                elapsed(s.comm_seconds_per_step()),
                size(s.bytes_per_step()),
                top,
                f"{s.imbalance():.2f}",
            ]
        )
    return Table(
        "Across stages",
        ["stage", "ranks", "steps", "comm / step", "bytes / step", "costliest op", "imbalance (max/mean)"],
        rows,
    )


def comparison_table(runs: dict[str, list[StageSummary]]) -> Table:
    rows = []
    for run, stages in runs.items():
        for s in stages:
            rows.append(
                [
                    run,
                    s.name,
                    str(len(s.ranks)),
                    elapsed(s.comm_seconds_per_step()),
                    size(s.bytes_per_step()),
                    *(rate(s.median_busbw(op)) for op in ("all_reduce", "all_gather", "reduce_scatter")),
                ]
            )
    return Table(
        "Comparison across runs",
        [
            "run",
            "stage",
            "ranks",
            "comm / step",
            "bytes / step",
            "all_reduce busbw",
            "all_gather busbw",
            "reduce_scatter busbw",
        ],
        rows,
    )
