"""metrics.jsonl on resume: the steps past the resumed one are dropped, and a last line cut short by
a kill or a full disk is dropped with it instead of stopping the resume."""

from __future__ import annotations

import json

import pytest

from stages.metrics import MetricsLogger


def open_log(path, resume_step: int) -> MetricsLogger:
    return MetricsLogger(path, True, resume_step, "disabled", "p", ("run", "run"), {})


def steps_in(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_resume_drops_the_steps_after_its_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3, 4)))
    open_log(path, resume_step=2).close()
    assert steps_in(path) == [1, 2]


def test_a_last_line_cut_short_is_dropped_and_logging_goes_on(tmp_path):
    path = tmp_path / "metrics.jsonl"
    whole = "".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in (1, 2))
    path.write_text(whole + json.dumps({"step": 3, "loss": 0.25})[:9])  # killed mid-write
    logger = open_log(path, resume_step=2)
    logger.log(3, {"loss": 0.25})
    logger.close()
    assert steps_in(path) == [1, 2, 3]


def test_a_damaged_line_before_the_last_is_an_error_naming_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"st\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2"):
        open_log(path, resume_step=3)
