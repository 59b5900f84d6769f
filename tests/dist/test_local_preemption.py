"""A USR1 sent to `hpcr1 run` (a batch system's warning before a time limit) reaches the ranks through
torchrun: they checkpoint the step they are at and stop, `hpcr1 run` exits with PREEMPTED_EXIT and
marks the stage pending (not failed), and the same command then resumes from that step to done."""
from __future__ import annotations

import json
import signal

import pytest

from runtime.preemption import PREEMPTED_EXIT
from tests.conftest import hpcr1_run, resumed_steps
from tests.dist.test_rank_failure import wait_until

pytestmark = [pytest.mark.dist, pytest.mark.slow]

# Long enough that the signal lands mid-stage, far from the periodic checkpoints.
LONG = ("stage1_sft.steps=400", "stage1_sft.checkpoint_every=200")


def steps_done(run_dir) -> list[int]:
    metrics = run_dir / "stage1_sft" / "metrics.jsonl"
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.exists() else []


def test_usr1_checkpoints_stops_and_resumes_where_it_stopped(tmp_path):
    run_dir = tmp_path / "run"
    proc = hpcr1_run(run_dir, *LONG, wait=False)
    wait_until(lambda: len(steps_done(run_dir)) >= 5, proc, "5 steps")
    proc.send_signal(signal.SIGUSR1)
    output = proc.communicate(timeout=300)[0].decode()

    assert proc.returncode == PREEMPTED_EXIT, output[-3000:]
    assert "stopped on a signal" in output
    entry = json.loads((run_dir / "manifest.json").read_text())["stages"]["stage1_sft"]
    assert (entry["state"], entry["preempted"]) == ("pending", 1)
    stopped_at = steps_done(run_dir)[-1]
    assert 5 <= stopped_at < 200, "the stop must come from the signal, not a periodic checkpoint or the end"
    assert (run_dir / "stage1_sft" / "ckpt" / f"step-{stopped_at:06d}").is_dir()

    hpcr1_run(run_dir, *LONG)
    assert resumed_steps(run_dir) == [stopped_at]
    assert steps_done(run_dir) == list(range(1, 401))
    assert json.loads((run_dir / "manifest.json").read_text())["stages"]["stage1_sft"]["state"] == "done"
