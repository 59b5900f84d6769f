"""stage3_synth as a stage's rank runs it (launch.worker: preemption handlers, PREEMPTED_EXIT), with
the model's sampling replaced by grpo_synth_stage.py's seeded stub, slowed down on every rank so
that a test's USR1 lands with batches sampled and batches left. argv = RUN_DIR STAGE_ID."""

from __future__ import annotations

import time

from grpo_synth_stage import stub_responses  # this script's directory is first on sys.path

from launch import worker
from stages import synth


def slow_stub_responses(*args):
    time.sleep(0.2)
    return stub_responses(*args)


if __name__ == "__main__":
    worker.die_with_launcher()
    synth.generate_responses = slow_stub_responses
    worker.main()
