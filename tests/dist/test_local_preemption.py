"""A USR1 sent to `hpcr1 run` (a batch system's warning before a time limit) reaches the ranks through
torchrun: they checkpoint the step they are at and stop, `hpcr1 run` exits with PREEMPTED_EXIT and
marks the stage pending (not failed), and the same command then resumes from that step. A USR1
after the last step (export or evaluation) stops the stage too, and the next attempt exports and
evaluates without training again."""

from __future__ import annotations

import json
import re
import signal

import pytest

from runtime.preemption import PREEMPTED_EXIT
from tests.conftest import hpcr1_run, resumed_steps
from tests.dist.test_rank_failure import wait_until

pytestmark = [pytest.mark.dist, pytest.mark.slow]

# No periodic checkpoint before the last step, so a stop before it can only be the signal's; the
# first signal goes once 5 steps are logged, and the 35 left are many times what the signal takes
# to reach the ranks (a step or two, loaded or not: the ranks' steps slow down with the rest). The
# second attempt trains to the end only so that its signal lands after the last step.
STEPS = 40
OVERRIDES = (f"stage1_sft.steps={STEPS}", f"stage1_sft.checkpoint_every={STEPS}")


def steps_done(run_dir) -> list[int]:
    metrics = run_dir / "stage1_sft" / "metrics.jsonl"
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.exists() else []


def test_usr1_checkpoints_stops_and_resumes_where_it_stopped(tmp_path):
    run_dir = tmp_path / "run"
    proc = hpcr1_run(run_dir, *OVERRIDES, wait=False)
    wait_until(lambda: len(steps_done(run_dir)) >= 5, proc, "5 steps")
    proc.send_signal(signal.SIGUSR1)
    output = proc.communicate(timeout=300)[0].decode()

    assert proc.returncode == PREEMPTED_EXIT, output[-3000:]
    assert "stopped on a signal" in output
    entry = json.loads((run_dir / "manifest.json").read_text())["stages"]["stage1_sft"]
    assert (entry["state"], entry["preempted"]) == ("pending", 1)
    stopped_at = steps_done(run_dir)[-1]
    assert 5 <= stopped_at < STEPS, "the stop must come from the signal, not the last step's checkpoint"
    assert (run_dir / "stage1_sft" / "ckpt" / f"step-{stopped_at:06d}").is_dir()

    proc = hpcr1_run(run_dir, *OVERRIDES, wait=False)
    log = run_dir / "stage1_sft" / "logs" / "rank-00000.log"
    wait_until(lambda: f"training done at step {STEPS}" in log.read_text(), proc, "the last step")
    proc.send_signal(signal.SIGUSR1)  # lands in the export or the evaluation of final/
    output = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode == PREEMPTED_EXIT, output[-3000:]
    entry = json.loads((run_dir / "manifest.json").read_text())["stages"]["stage1_sft"]
    assert (entry["state"], entry["preempted"]) == ("pending", 2)
    assert re.search(
        r"stopping (before exporting|before evaluating|while evaluating) final/", log.read_text()
    )
    assert not (run_dir / "stage1_sft" / "eval.json").exists()

    hpcr1_run(run_dir, *OVERRIDES)
    assert resumed_steps(run_dir) == [stopped_at, STEPS]
    assert steps_done(run_dir) == list(range(1, STEPS + 1)), "no step trained twice"
    assert log.read_text().count(": exported ") == 1, "final/ exported once, by either attempt"
    entry = json.loads((run_dir / "manifest.json").read_text())["stages"]["stage1_sft"]
    assert entry["state"] == "done" and entry["eval"]["n"] == 16
