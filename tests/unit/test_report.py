"""The report: one self-contained HTML that renders in headless Chromium with every figure, a
Markdown file with the same tables, GRPO's three phases side by side, a straggler named."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest

from analysis.report import write_report
from analysis.tables import elapsed, rate
from tests.conftest import markdown_table, markdown_tables, seconds
from tests.support.system_packages import system_command

RANKS = (0, 1)


def event(rank, step, phase, op, nbytes, seq, t0, dur, async_op=False):
    return {
        "stage": "",
        "step": step,
        "phase": phase,
        "rank": rank,
        "op": op,
        "bytes": nbytes,
        "dtype": "float32",
        "group_size": 2,
        "group_ranks": [0, 1],
        "peer": None,
        "seq": seq,
        "t_start": t0,
        "t_end": t0 + dur,
        "backend": "gloo",
        "source": "torch.distributed",
        "async_op": async_op,
    }


def write_stage(run: Path, stage: str, phases: list[str], late_rank: int = 1, late_s: float = 0.02) -> None:
    """Two ranks, 3 steps, one all-reduce and one all-gather per phase; `late_rank` always arrives late."""
    profile = run / stage / "profile"
    profile.mkdir(parents=True)
    t = 1000.0
    rows = {r: [] for r in RANKS}
    seq = {"all_reduce": 0, "all_gather": 0}
    for step in (1, 2, 3):
        for phase in phases:
            for op, nbytes in (("all_reduce", 1 << 20), ("all_gather", 1 << 16)):
                for r in RANKS:
                    start = t + (late_s if r == late_rank else 0.0)
                    rows[r].append(
                        event(r, step, phase, op, nbytes, seq[op], start, t + late_s + 0.005 - start)
                    )
                seq[op] += 1
                t += 0.1
    for r in RANKS:
        (profile / f"rank-{r:05d}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in rows[r]))
    metrics = [{"step": s, **{f"phase_time/{p}": 0.2 for p in phases}} for s in (1, 2, 3)]
    (run / stage / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    for name, late in (("ranks2", 1), ("ranks2-again", 0)):
        write_stage(root / name, "stage1_sft", ["forward", "backward", "optimizer"], late_rank=late)
        write_stage(
            root / name,
            "stage2_grpo",
            ["rollout", "policy_logprob", "reference_logprob", "policy_update"],
            late_rank=late,
        )
    (root / "ranks2" / "commbench.json").write_text(
        json.dumps(
            {
                "backend": "gloo",
                "world_size": 2,
                "results": {
                    "all_reduce": [
                        {"bytes": b, "latency_us": 1.0, "algbw_GBps": 1.0, "busbw_GBps": 1.0}
                        for b in (1024, 1 << 20)
                    ]
                },
            }
        )
    )
    out = root / "report"
    write_report([root / "ranks2", root / "ranks2-again"], out)
    return out


class TableReader(HTMLParser):
    """Cells of every <table>, and every <img>'s alt."""

    def __init__(self):
        super().__init__()
        self.tables, self.images, self._cell = [], [], None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = ""
        elif tag == "img":
            self.images.append(dict(attrs)["alt"])

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.tables[-1][-1].append(self._cell)
            self._cell = None


def test_markdown_holds_the_same_tables_and_figures_as_the_html(report):
    reader = TableReader()
    reader.feed((report / "index.html").read_text())
    md = (report / "report.md").read_text()
    assert reader.tables == markdown_tables(md) and len(reader.tables) > 10
    pngs = sorted(p.stem for p in report.glob("*.png"))
    assert sorted(reader.images) == pngs and all(f"![{p}]({p}.png)" in md for p in pngs)


def test_html_is_self_contained(report):
    page = (report / "index.html").read_text()
    assert "src='data:image/png;base64," in page and "http" not in page.replace("http-equiv", "")


def test_grpo_stage_gets_the_three_phase_panels_and_non_grpo_does_not(report):
    pngs = {p.name for p in report.glob("*.png")}
    assert {"ranks2-stage2_grpo-grpo-panels.png", "ranks2-again-stage2_grpo-grpo-panels.png"} <= pngs
    assert not any("stage1_sft-grpo-panels" in p for p in pngs)
    md = (report / "report.md").read_text().split("## Run ranks2-again\n")[0]
    sft, grpo = md.split("### stage1_sft\n")[1].split("### stage2_grpo\n")
    title = "GRPO phases side by side: communication per rank over the stage"
    assert title not in sft
    header, *rows = markdown_table(grpo, title)
    assert header[1::3] == ["policy_update calls", "policy_logprob calls", "reference_logprob calls"]
    # write_stage: one all-reduce and one all-gather a phase and step, 3 steps;
    # the two ranks spend 25 + 5 ms a call
    assert rows == [
        ["all_gather", *["3", "192.00 KiB", "45.00 ms"] * 3],
        ["all_reduce", *["3", "3.00 MiB", "45.00 ms"] * 3],
    ]


def test_bytes_by_phase_are_what_each_phase_sent(report):
    md = (report / "report.md").read_text().split("### stage1_sft\n")[1]
    rows = markdown_table(md, "Communication bytes by phase and operation (per rank)")
    assert rows == [
        ["phase", "all_gather", "all_reduce"],
        *([p, "192.00 KiB", "3.00 MiB"] for p in ("forward", "backward", "optimizer")),  # step order
    ]


def test_the_late_rank_is_named_slowest_and_the_other_carries_the_wait(report):
    md = (report / "report.md").read_text()
    section = md.split("## Run ranks2\n")[1].split("### stage2_grpo")[0]
    per_rank = next(t for t in markdown_tables(section) if t[0][0] == "rank")
    rows = {row[0]: row for row in per_rank[1:]}  # rank, comm, wait, times slowest, overlap
    assert rows["1"][3] == str(3 * 3 * 2) and rows["0"][3] == "0"
    assert rows["0"][2] == "360.0 ms" and rows["1"][2] == "0"


def test_html_renders_in_headless_chromium_with_every_figure_and_no_console_error(report, tmp_path):
    shot = tmp_path / "shot.png"
    base = [
        system_command("chromium", "chromium-browser"),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--hide-scrollbars",
        f"--user-data-dir={tempfile.mkdtemp()}",
        "--window-size=1200,2000",
    ]
    url = (report / "index.html").as_uri()
    shot_run = subprocess.run(
        [*base, "--enable-logging=stderr", "--v=0", f"--screenshot={shot}", url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    dom = subprocess.run(
        [*base, "--virtual-time-budget=5000", "--dump-dom", url], capture_output=True, text=True, timeout=120
    ).stdout
    console = [line for line in shot_run.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert console == []
    figures = len(list(report.glob("*.png")))
    assert f'data-figures="{figures}"' in dom and 'data-broken-figures="0"' in dom
    from PIL import Image

    image = Image.open(shot).convert("L")
    low, high = image.getextrema()
    assert image.size[0] > 0 and high - low > 100, "screenshot is blank"


@pytest.mark.parametrize("command", ["report", "commbench"])
def test_hpcr1_hands_options_to_the_commands_own_parser(command, capsys):
    from pipeline.cli import main

    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: hpcr1 {command} ")


def unprofiled_run(tmp_path: Path) -> Path:
    """A run directory whose stage ran without the profiler: a config and metrics, no profile/."""
    write_stage(tmp_path / "run", "stage1_sft", ["forward"])
    shutil.rmtree(tmp_path / "run" / "stage1_sft" / "profile")
    (tmp_path / "run" / "config.yaml").write_text("name: run\n")
    return tmp_path / "run"


@pytest.mark.parametrize(
    "make_dir,reason",
    [
        (lambda tmp: tmp / "missing", "not a run directory: {dir} (no such directory)"),
        (lambda tmp: tmp, "not a run directory: {dir} (no config.yaml)"),
        (unprofiled_run, "no communication profile in {dir}"),
    ],
    ids=["missing", "not-a-run", "no-profile"],
)
def test_hpcr1_report_on_what_it_cannot_report_is_bad_input_and_writes_nothing(
    make_dir, reason, tmp_path, capsys
):
    from pipeline.cli import main

    run = make_dir(tmp_path)
    with pytest.raises(SystemExit) as done:
        main(["report", "--out", str(tmp_path / "out"), str(run)])
    err = capsys.readouterr().err
    assert done.value.code == 2 and reason.format(dir=run) in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and not (run / "report").exists()


def test_runs_with_the_same_name_in_different_folders_are_both_reported(tmp_path):
    for site in ("site-a", "site-b"):
        write_stage(tmp_path / site / "runs" / "tiny-cpu", "stage2_grpo", ["rollout", "policy_update"])
    out = tmp_path / "report"
    write_report([tmp_path / "site-a" / "runs" / "tiny-cpu", tmp_path / "site-b" / "runs" / "tiny-cpu"], out)
    md = (out / "report.md").read_text()
    assert "## Run site-a/runs/tiny-cpu\n" in md and "## Run site-b/runs/tiny-cpu\n" in md
    comparison = markdown_table(md, "Comparison across runs")
    assert [row[0] for row in comparison[1:]] == ["site-a/runs/tiny-cpu", "site-b/runs/tiny-cpu"]
    assert {"site-a_runs_tiny-cpu-stage2_grpo-phases.png", "site-b_runs_tiny-cpu-stage2_grpo-phases.png"} <= {
        p.name for p in out.glob("*.png")
    }


@pytest.mark.parametrize(
    "seconds_in,text",
    [
        (102.19674, "102.2 s"),
        (1.0, "1.000 s"),
        (0.99996, "1.000 s"),  # rounds up into the next unit, not "1000 ms"
        (0.016877, "16.88 ms"),
        (0.0009523, "952.3 µs"),
        (3e-8, "0.03000 µs"),
        (0.0, "0"),
    ],
)
def test_times_carry_the_unit_that_fits_their_size(seconds_in, text):
    assert elapsed(seconds_in) == text and seconds(text) == pytest.approx(seconds_in, rel=1e-3, abs=1e-12)


@pytest.mark.parametrize(
    "bytes_per_s,text",
    [
        (12.3e9, "12.30 GB/s"),
        (4.56e6, "4.560 MB/s"),
        (89_000.0, "89.00 KB/s"),
        (12.0, "12.00 B/s"),
        (0.0, "-"),  # no call measured
    ],
)
def test_bandwidth_carries_the_unit_that_fits_its_size(bytes_per_s, text):
    assert rate(bytes_per_s) == text


def test_the_report_opens_with_each_runs_headline_findings_before_any_table(report):
    md = (report / "report.md").read_text()
    head = md.split("\n|", 1)[0]
    first, again = head.split("## Headline findings\n", 1)[1].split("Run ranks2-again:")
    for findings, late in ((first, 1), (again, 0)):
        costs = [line for line in findings.splitlines() if line[:3] in ("1. ", "2. ", "3. ")]
        assert len(costs) == 3 and all(" per rank, " in line for line in costs), findings
        assert f"- Slowest rank: rank {late} of stage" in findings
        assert "- Most exposed communication: " in findings


def test_the_report_writes_each_runs_timeline_and_says_where(report):
    md = (report / "report.md").read_text()
    for run in ("ranks2", "ranks2-again"):
        trace = json.loads((report / f"{run}-timeline.json").read_text())
        assert trace["otherData"]["run"] == run and any(e["ph"] == "X" for e in trace["traceEvents"])
        assert f"Timeline: {run}-timeline.json, " in md.split(f"## Run {run}\n", 1)[1].split("|", 1)[0]
