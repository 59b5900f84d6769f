"""bench/robustness.py without its 9 runs: each math-kernel path's variables make torch use that
path (asked of torch in a fresh interpreter), the min/median/max and the criteria are those of the
figures, and bad options are refused before anything runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
from robustness import KERNEL_VARS, criteria, figures, kernel_env, summary, torch_capability  # noqa: E402

BENCH = REPO / "bench" / "robustness.py"


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in KERNEL_VARS}


def test_each_kernel_path_is_the_one_torch_then_uses():
    best = torch_capability(clean_env())
    assert best in ("DEFAULT", "AVX2", "AVX512")
    for path, expected in (("default", "DEFAULT"), ("avx2", "AVX2"), ("best", best)):
        if path == "avx2" and best == "DEFAULT":
            continue  # a machine without AVX2 cannot take that path
        env = kernel_env(path)
        assert set(env) == set(KERNEL_VARS)
        assert torch_capability({**clean_env(), **env}) == expected, path
    assert kernel_env("default")["MKL_ENABLE_INSTRUCTIONS"] == "SSE4_2"
    assert kernel_env("avx2")["DNNL_MAX_CPU_ISA"] == "AVX2"


def run(s1, s2, s3, s4):
    """A run's manifest entries: greedy figures as given, mean@k 0.02 below them (the same gains), and
    the validation figures all 0.5, without mean@k."""
    entry = {}
    for sid, acc in zip(("stage1_sft", "stage2_grpo", "stage3_sft", "stage4_grpo"), (s1, s2, s3, s4)):
        entry[sid] = {"accuracy": acc, "mean_at_k": acc - 0.02, "validation": {"accuracy": 0.5}}
    return entry


def verdicts(rows, walls=(600.0,)):
    return {text: ok for text, ok, _ in criteria(rows, list(walls))}


def test_summary_is_min_median_max_of_each_column():
    runs = [run(0.3, 0.6, 0.5, 0.55), run(0.2, 0.5, 0.4, 0.5), run(0.5, 0.9, 0.7, 0.7)]
    stats = summary([figures(r, "eval") for r in runs])
    assert stats["s1 greedy"] == (0.2, 0.3, 0.5)
    assert stats["s4 greedy"] == (0.5, 0.55, 0.7)
    assert stats["s2 mean@k"] == pytest.approx((0.48, 0.58, 0.88))
    # the validation split has no mean@k here: a column of nothing has no summary
    validation = summary([figures(r, "validation") for r in runs])
    assert validation["s1 greedy"] == (0.5, 0.5, 0.5) and validation["s1 mean@k"] is None


GOOD = [run(0.30, 0.50, 0.45, 0.50), run(0.40, 0.60, 0.55, 0.58), run(0.25, 0.45, 0.40, 0.43)]


def failing(runs, walls=(600.0,)) -> list[str]:
    return sorted(t for t, ok in verdicts([figures(r, "eval") for r in runs], walls).items() if not ok)


def test_criteria_pass_where_every_run_meets_them():
    assert failing(GOOD) == []
    assert failing(GOOD, walls=(600.0, 13 * 60.0)) == ["every run under 12 minutes"]


@pytest.mark.parametrize(
    "bad_run, criterion",
    [
        ((0.75, 0.95, 0.90, 0.95), "stage1 within [0.20, 0.70] in every run"),
        ((0.30, 0.44, 0.45, 0.50), "stage2 >= stage1 + 0.15 in every run"),
        ((0.30, 0.50, 0.39, 0.45), "stage3_sft >= stage1 + 0.10 in every run"),
        ((0.30, 0.50, 0.45, 0.42), "stage4 never below stage3_sft - 0.02"),
    ],
)
def test_one_run_that_misses_a_criterion_fails_that_criterion_alone(bad_run, criterion):
    # for greedy and for mean@k alike: the runs' gains are the same in both here
    assert failing([*GOOD, run(*bad_run)]) == [f"greedy: {criterion}", f"mean@k: {criterion}"]


def test_stage4_is_judged_on_the_median_of_its_gains():
    # gains over stage3_sft of +0.05, +0.04, +0.00, -0.01: median +0.02, under +0.03
    rows = [figures(run(0.3, 0.5, 0.45, 0.45 + g), "eval") for g in (0.05, 0.04, 0.0, -0.01)]
    assert not verdicts(rows)["greedy: stage4 >= stage3_sft + 0.03 in the median"]
    rows.append(figures(run(0.3, 0.5, 0.45, 0.50), "eval"))  # median now +0.04
    assert verdicts(rows)["greedy: stage4 >= stage3_sft + 0.03 in the median"]


def test_a_missing_mean_at_k_is_a_failure_not_a_crash():
    rows = [figures(run(0.3, 0.5, 0.45, 0.5), "eval")]
    rows[0]["s2 mean@k"] = None
    results = verdicts(rows)
    assert not results["mean@k given in every run"] and results["greedy given in every run"]


@pytest.mark.parametrize(
    "args, message",
    [(["--paths", "avx9"], "--paths: unknown path 'avx9'"), (["--seeds", "0,x"], "--seeds: '0,x'")],
)
def test_bad_options_are_refused_naming_the_option(args, message, tmp_path):
    out = subprocess.run(
        [sys.executable, str(BENCH), *args, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and message in out.stderr
    assert not any(tmp_path.iterdir()), "nothing may run before the options are checked"
