"""`hpcr1 report RUN_DIR [RUN_DIR ...]`: per stage, where communication time goes (by operation,
phase and rank), as report/index.html (one self-contained file, figures embedded), report/report.md
(the same tables), the PNG figures and report/timeline.json (every call on one time axis, a Chrome
trace: analysis/timeline.py)."""

from __future__ import annotations

import argparse
import base64
import html
import json
import sys
from pathlib import Path

from analysis import figures, headline, scaling, timeline
from analysis.breakdown import StageSummary, summarise_stage
from analysis.events import stage_dirs
from analysis.nccl_inspector import add_section as inspector_section
from analysis.nccl_transport import detect_in_logs
from analysis.tables import Table, comparison_table, cross_stage_table, stage_tables
from core.rundir import RunDir

# After loading, the page counts its figures that failed to decode; a headless browser test reads
# the count back from the DOM (data-broken-figures="0").
RENDERED_CHECK = (
    "<script>window.addEventListener('load',()=>{const imgs=[...document.querySelectorAll('img.figure')];"
    "document.body.dataset.figures=imgs.length;document.body.dataset.brokenFigures="
    "imgs.filter(i=>!i.complete||i.naturalWidth===0).length;});</script>"
)
STYLE = (
    "body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;margin:.5em 0}"
    "td,th{border:1px solid #bbb;padding:2px 6px;font-size:13px;text-align:right}img{max-width:100%}"
)


def find_commbench(run_dirs: list[Path]) -> dict | None:
    for run in run_dirs:
        path = run / "commbench.json"
        if path.exists():
            return json.loads(path.read_text())
    return None


def stage_figures(s: StageSummary, out_dir: Path, prefix: str, commbench: dict | None) -> list[Path]:
    stem = out_dir / f"{prefix}{s.name}"
    made = [
        figures.phase_split(s, Path(f"{stem}-phases.png")),
        figures.comm_by_phase_op(s, Path(f"{stem}-comm-by-phase.png")),
        figures.bandwidth_vs_size(s, Path(f"{stem}-busbw.png"), commbench),
        figures.size_histogram(s, Path(f"{stem}-sizes.png")),
        figures.per_rank(s, Path(f"{stem}-ranks.png")),
    ]
    if s.has_grpo_panels():
        made.insert(1, figures.grpo_panels(s, Path(f"{stem}-grpo-panels.png")))
    return made


class Document:
    """Sections appended once, written as Markdown and as HTML side by side."""

    def __init__(self, title: str):
        self.md = [f"# {title}\n"]
        self.html = [
            f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
        ]

    def heading(self, text: str, level: int = 2) -> None:
        self.md.append(f"{'#' * level} {text}\n")
        self.html.append(f"<h{level}>{html.escape(text)}</h{level}>")

    def paragraph(self, text: str) -> None:
        self.md.append(text + "\n")
        self.html.append(f"<p>{html.escape(text)}</p>")

    def items(self, lines: list[str], ordered: bool = False) -> None:
        self.md.append(
            "\n".join(f"{f'{i}.' if ordered else '-'} {line}" for i, line in enumerate(lines, 1)) + "\n"
        )
        tag = "ol" if ordered else "ul"
        self.html.append(
            f"<{tag}>" + "".join(f"<li>{html.escape(line)}</li>" for line in lines) + f"</{tag}>"
        )

    def table(self, table: Table) -> None:
        self.md.append(table.markdown())
        self.html.append(table.html())

    def figure(self, path: Path) -> None:
        self.md.append(f"![{path.stem}]({path.name})\n")
        data = base64.b64encode(path.read_bytes()).decode()
        self.html.append(f"<img class='figure' alt='{path.stem}' src='data:image/png;base64,{data}'>")

    def write(self, out_dir: Path) -> None:
        (out_dir / "report.md").write_text("\n".join(self.md))
        (out_dir / "index.html").write_text("\n".join(self.html) + RENDERED_CHECK + "</body></html>\n")


def transport_note(doc: Document, stage_dir: Path) -> None:
    found = detect_in_logs(stage_dir / "logs")
    if found is None:
        return
    doc.paragraph(
        f"NCCL network: {', '.join(sorted(found.networks)) or 'unknown'}; inter-node channels: "
        f"{', '.join(sorted(found.inter_node)) or 'none'}; "
        f"intra-node: {', '.join(sorted(found.intra_node)) or 'none'}"
        f"; nodes: {found.nodes}."
    )
    if found.warning:
        doc.paragraph("WARNING: " + found.warning)


def run_labels(run_dirs: list[Path]) -> list[str]:
    """Each run's directory name, with as many parent folders as it takes to tell apart distinct
    runs of the same name (/a/runs/tiny-cpu, /b/runs/tiny-cpu -> a/runs/tiny-cpu, b/runs/tiny-cpu)."""
    depth = 1
    while len({"/".join(r.parts[-depth:]) for r in run_dirs}) < len(run_dirs):
        depth += 1
    return ["/".join(r.parts[-depth:]) for r in run_dirs]


def headline_section(doc: Document, runs: dict[str, list[StageSummary]]) -> None:
    """The findings first (analysis/headline.py), so that a reader knows what the tables below show."""
    doc.heading("Headline findings")
    for run, stages in runs.items():
        if len(runs) > 1:
            doc.paragraph(f"Run {run}:")
        doc.paragraph("Largest communication costs (operation in phase, time per rank over the stage):")
        doc.items(headline.costliest(stages), ordered=True)
        doc.items([headline.slowest_rank(stages), headline.most_exposed(stages)])


def timeline_section(doc: Document, stages: list[StageSummary], run: str, path: Path) -> None:
    timeline.write_timeline(stages, run, path)
    doc.paragraph(
        f"Timeline: {path.name}, every call of every rank on one time axis, in the Chrome trace format "
        "(open it in ui.perfetto.dev or chrome://tracing): a process per stage and rank, with its steps "
        "and phases (drawn from its calls), its calls, and an arrow from the first rank to reach each "
        "collective to the last, the one the others waited for (analysis/timeline.py)."
    )
    large = timeline.large_stages(stages)
    if large:
        doc.paragraph(
            f"{', '.join(large)}: more than {timeline.LARGE_STAGE:,} calls, all kept in the timeline, "
            "which may load slowly."
        )


def scaling_section(doc: Document, run_dirs: list[Path], labels: list[str], out_dir: Path) -> None:
    stages, left_out = scaling.scaling(run_dirs, labels)
    doc.heading("Scaling")
    doc.paragraph(
        "Weak scaling: the batch per GPU is the same at every scale. Throughput over every step but the "
        "first; efficiency = samples/s per GPU relative to the smallest scale; comm fraction = share of "
        "step time a rank was blocked in communication (async calls overlapped with compute do not "
        "count), averaged over ranks. Definitions: analysis/scaling.py. Numbers: scaling.json."
    )
    if left_out:
        doc.paragraph("Left out (no throughput in metrics.jsonl): " + ", ".join(left_out) + ".")
    scaling.write_scaling_json(stages, out_dir / "scaling.json")
    for table, (stage, points) in zip(scaling.scaling_tables(stages), stages.items()):
        doc.table(table)
        doc.figure(scaling.scaling_figure(stage, points, out_dir / f"scaling-{stage}.png"))


def write_report(run_dirs: list[Path], out_dir: Path, commbench: dict | None = None) -> Path:
    """Write index.html, report.md and the PNGs into out_dir; returns the HTML's path."""
    run_dirs = list(dict.fromkeys(Path(r).resolve() for r in run_dirs))  # a directory given twice counts once
    out_dir.mkdir(parents=True, exist_ok=True)
    commbench = commbench or find_commbench(run_dirs)
    dirs = {label: stage_dirs(run) for label, run in zip(run_labels(run_dirs), run_dirs)}
    runs = {name: [summarise_stage(d) for d in stages] for name, stages in dirs.items()}
    doc = Document("Communication report: " + ", ".join(runs))
    headline_section(doc, runs)
    doc.paragraph(
        "Times are wall-clock per rank. Waiting = how long a rank sat in a collective before the last "
        "rank arrived; the last to arrive is the slowest rank. Overlap counts only async calls "
        "(see analysis/overlap.py)."
    )
    if scaling.is_scaling_set(run_dirs):
        scaling_section(doc, run_dirs, list(runs), out_dir)
    for run, stages in runs.items():
        prefix = f"{run.replace('/', '_')}-" if len(runs) > 1 else ""
        doc.heading(f"Run {run}")
        timeline_section(doc, stages, run, out_dir / f"{prefix}timeline.json")
        if stages:
            doc.table(cross_stage_table(stages))
        for s, stage_dir in zip(stages, dirs[run]):
            doc.heading(s.name, 3)
            transport_note(doc, stage_dir)
            for table in stage_tables(s):
                doc.table(table)
            for problem in s.clock_problems():
                doc.paragraph(f"WARNING, inconsistent times: {problem}.")
            inspector_section(doc, stage_dir)
            for path in stage_figures(s, out_dir, prefix, commbench):
                doc.figure(path)
    if len(runs) > 1:
        doc.heading("Comparison")
        doc.table(comparison_table(runs))
        doc.figure(figures.across_runs(runs, out_dir / "comparison.png"))
    doc.write(out_dir)
    return out_dir / "index.html"


def started_scales(sweep_dir: Path) -> list[Path]:
    """The sweep's run directories that exist (a scale still queued has none yet)."""
    listed = scaling.sweep_run_dirs(sweep_dir)
    for run in listed:
        if not (run / "config.yaml").is_file():
            print(f"hpcr1 report: {run} has not started; left out", file=sys.stderr)
    return [run for run in listed if (run / "config.yaml").is_file()]


def unusable(run: Path) -> str | None:
    """Why `run` cannot be reported on, or None: a report of nothing would read as a run that did not
    communicate."""
    if not run.is_dir():
        return f"not a run directory: {run} (no such directory)"
    if not RunDir(run).config.is_file():
        return f"not a run directory: {run} (no config.yaml)"
    if not stage_dirs(run):
        return (
            f"no communication profile in {run} (<stage>/profile/rank-*.jsonl): no stage has run yet, "
            "or they ran with profile.comm: false"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hpcr1 report", description=__doc__)
    parser.add_argument(
        "run_dirs",
        nargs="+",
        type=Path,
        metavar="RUN_DIR",
        help="run directories (compared when several; a scaling section when their sizes differ), "
        "or the directory of an `hpcr1 sweep`",
    )
    parser.add_argument("--out", type=Path, help="default: <first run>/report")
    parser.add_argument("--commbench", type=Path, help="a commbench JSON to draw as achievable bandwidth")
    args = parser.parse_args(argv)
    out = args.out or args.run_dirs[0] / "report"
    if len(args.run_dirs) == 1 and (args.run_dirs[0] / scaling.SWEEP_FILE).is_file():
        args.run_dirs = started_scales(args.run_dirs[0]) or parser.error("no scale of the sweep has started")
    problems = [why for why in map(unusable, args.run_dirs) if why]
    if problems:
        parser.error("; ".join(problems))
    bench = json.loads(args.commbench.read_text()) if args.commbench else None
    print(write_report(args.run_dirs, out, bench))
    return 0
