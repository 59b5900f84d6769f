"""The report's figures (matplotlib, Agg): each function draws one PNG and returns its path."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from analysis.breakdown import StageSummary  # noqa: E402


def save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def phase_split(s: StageSummary, path: Path) -> Path:
    rows = s.phase_split()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r[0] for r in rows]
    ax.barh(names, [r[3] * 1e3 for r in rows], label="compute")
    ax.barh(names, [r[2] * 1e3 for r in rows], left=[r[3] * 1e3 for r in rows], label="exposed communication")
    ax.invert_yaxis()  # the step's first phase on top, as in the table
    ax.set_xlabel("ms (rank 0, whole stage)")
    ax.set_title(f"{s.name}: time by phase")
    ax.legend()
    return save(fig, path)


def comm_by_phase_op(s: StageSummary, path: Path, phases: list[str] | None = None, title: str = "") -> Path:
    table = s.by_phase_op()
    phases = phases or sorted(table, key=s.phase_key)
    ops = sorted({op for p in phases for op in table.get(p, {})})
    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.4 * max(3, len(phases))))
    left = [0.0] * len(phases)
    for op in ops:
        widths = [table.get(p, {}).get(op, 0.0) * 1e3 for p in phases]
        ax.barh(phases, widths, left=left, label=op)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("communication ms per rank")
    ax.set_title(title or f"{s.name}: communication by phase and operation")
    if ops:
        ax.legend(fontsize=7)
    return save(fig, path)


def grpo_panels(s: StageSummary, path: Path) -> Path:
    """Policy update, policy log-probs and reference log-probs side by side, on one scale."""
    panels = s.grpo_panels()
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2), sharey=True)
    ops = sorted({op for per in panels.values() for op in per})
    for ax, (panel, per) in zip(axes, panels.items()):
        ax.bar(
            ops,
            [per[op].seconds * 1e3 if op in per else 0.0 for op in ops],
            color=[f"C{i}" for i in range(len(ops))],
        )
        ax.set_title(panel)
        ax.tick_params(axis="x", rotation=45, labelsize=7)
    axes[0].set_ylabel("communication ms per rank")
    fig.suptitle(f"{s.name}: GRPO phases")
    return save(fig, path)


def bandwidth_vs_size(s: StageSummary, path: Path, commbench: dict | None) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, op in enumerate(sorted({e["op"] for e in s.events} - {"barrier"})):
        points = s.bandwidth_points(op)
        if points:
            ax.scatter([b for b, _ in points], [bw / 1e9 for _, bw in points], s=10, color=f"C{i}", label=op)
        bench = (commbench or {}).get("results", {}).get("send_recv" if op in ("send", "recv") else op)
        if bench:
            ax.plot(
                [r["bytes"] for r in bench],
                [r["busbw_GBps"] for r in bench],
                color=f"C{i}",
                linestyle="--",
                label=f"{op} (commbench)",
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("message bytes")
    ax.set_ylabel("bus bandwidth GB/s")
    ax.set_title(f"{s.name}: bus bandwidth per call vs achievable")
    ax.legend(fontsize=7)
    return save(fig, path)


def size_histogram(s: StageSummary, path: Path) -> Path:
    sizes = s.message_sizes()
    fig, ax = plt.subplots(figsize=(7, 3))
    if sizes:
        top = max(sizes).bit_length() + 1
        ax.hist(sizes, bins=[2**k for k in range(0, top)])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message bytes (rank 0)")
    ax.set_ylabel("calls")
    ax.set_title(f"{s.name}: message sizes")
    return save(fig, path)


def per_rank(s: StageSummary, path: Path) -> Path:
    rows = s.per_rank()
    fig, ax = plt.subplots(figsize=(7, 3))
    ranks = [str(r[0]) for r in rows]
    ax.bar(ranks, [(r[1] - r[2]) * 1e3 for r in rows], label="in calls, not waiting")
    ax.bar(
        ranks,
        [r[2] * 1e3 for r in rows],
        bottom=[(r[1] - r[2]) * 1e3 for r in rows],
        label="waiting for others",
    )
    ax.set_xlabel("rank")
    ax.set_ylabel("ms")
    ax.set_title(f"{s.name}: per-rank communication and straggler wait")
    ax.legend(fontsize=7)
    return save(fig, path)


def across_runs(runs: dict[str, list[StageSummary]], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 3.5))
    labels = [f"{run}\n{s.name}" for run, stages in runs.items() for s in stages]
    values = [s.comm_seconds_per_step() * 1e3 for stages in runs.values() for s in stages]
    ax.bar(labels, values)
    ax.set_ylabel("comm ms / step / rank")
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title("Communication per step across runs and stages")
    return save(fig, path)
