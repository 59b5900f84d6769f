"""A real weak-scaling sweep here: `hpcr1 sweep` runs stage 1 of the tiny model on 1, 2, 3 and 4
ranks (gloo, oversubscribed), then `hpcr1 report` over the sweep has a scaling table and figure
whose numbers are those of each run's metrics.jsonl, worked out again here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO, hpcr1_env, markdown_table

pytestmark = [pytest.mark.dist, pytest.mark.slow]

GPUS = (1, 2, 3, 4)
PER_GPU_BATCH = 4
SHRINK = [
    "stage1_sft.steps=4",
    "stage1_sft.micro_batch_size=4",
    "stage3_sft.micro_batch_size=4",
    "stage1_sft.checkpoint_every=100",
    "model.tiny.hidden_size=64",
    "model.tiny.num_layers=2",
    "model.tiny.ffn_hidden_size=128",
    "data.arithmetic.sft_size=256",
    "data.arithmetic.prompts_size=16",
    "data.arithmetic.eval_size=8",
    "eval.num_examples=4",
    "eval.max_new_tokens=8",
    "wandb.mode=disabled",
]


def hpcr1(*args: str) -> subprocess.CompletedProcess:
    # One thread a rank at every scale, so that one rank does not get the cores that four share.
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**hpcr1_env(), "OMP_NUM_THREADS": "1"},
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep") / "tiny"
    hpcr1(
        "sweep",
        str(REPO / "configs" / "tiny-cpu.yaml"),
        "--gpus",
        ",".join(map(str, GPUS)),
        "--per-gpu-batch",
        str(PER_GPU_BATCH),
        "--only",
        "stage1_sft",
        "--sweep-dir",
        str(root),
        *SHRINK,
    )
    hpcr1("report", str(root))
    return root


def expected_throughput(run_dir) -> tuple[float, float]:
    """samples/s and tokens/s over every step but the first, from the batch size the run was
    configured with and the step times and token rates its metrics recorded."""
    batch = yaml.safe_load((run_dir / "config.yaml").read_text())["stage1_sft"]["global_batch_size"]
    steps = [
        json.loads(line) for line in (run_dir / "stage1_sft" / "metrics.jsonl").read_text().splitlines()
    ][1:]
    seconds = sum(s["step_time_s"] for s in steps)
    return batch * len(steps) / seconds, sum(s["tokens_per_s"] * s["step_time_s"] for s in steps) / seconds


def test_each_scale_ran_with_the_batch_grown_with_its_ranks(sweep):
    for n in GPUS:
        cfg = yaml.safe_load((sweep / f"gpus-{n:04d}" / "config.yaml").read_text())
        assert cfg["nproc"] == n and cfg["stage1_sft"]["global_batch_size"] == PER_GPU_BATCH * n
        assert len(list((sweep / f"gpus-{n:04d}" / "stage1_sft" / "profile").glob("rank-*.jsonl"))) == n


def test_scaling_table_has_a_row_per_scale_with_the_metrics_throughput(sweep):
    report = sweep / "report"
    rows = markdown_table((report / "report.md").read_text(), "Weak scaling: stage1_sft")
    header, rows = rows[0], rows[1:]
    assert [r[header.index("GPUs")] for r in rows] == [str(n) for n in GPUS]
    assert rows[0][header.index("efficiency")] == "1.000"
    points = json.loads((report / "scaling.json").read_text())["stage1_sft"]
    samples_1 = expected_throughput(sweep / "gpus-0001")[0]
    for point, row, n in zip(points, rows, GPUS):
        samples, tokens = expected_throughput(sweep / f"gpus-{n:04d}")
        assert point["gpus"] == n and point["measured_steps"] == 3
        assert point["samples_per_s"] == pytest.approx(samples, rel=1e-9)
        assert point["tokens_per_s"] == pytest.approx(tokens, rel=1e-9)
        assert point["efficiency"] == pytest.approx((samples / n) / samples_1, rel=1e-9)
        assert (
            row[header.index("samples/s")] == f"{samples:.2f}"
            and row[header.index("tokens/s")] == f"{tokens:.1f}"
        )


def test_comm_fraction_is_zero_on_one_rank_and_positive_on_more(sweep):
    points = json.loads((sweep / "report" / "scaling.json").read_text())["stage1_sft"]
    assert points[0]["comm_fraction"] == 0.0
    for point in points[1:]:
        assert 0.0 < point["comm_fraction"] < 1.0, point


def test_scaling_figure_is_in_both_reports(sweep):
    report = sweep / "report"
    png = report / "scaling-stage1_sft.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "![scaling-stage1_sft](scaling-stage1_sft.png)" in (report / "report.md").read_text()
    assert "alt='scaling-stage1_sft'" in (report / "index.html").read_text()
