"""Device clocks on a simulated GPU (tests/support/simulated_gpu.py): the communication profiler's
CUDA times stay exact to the microsecond after a day of stage, and phase times are the device's,
not the host's, so GPU work is credited to the phase that issued it."""

from __future__ import annotations

import json

import pytest
import torch

from runtime import phases
from runtime.comm_profiler import T_END, CommProfiler
from runtime.device_clock import DeviceClock
from tests.support.simulated_gpu import NS, SimulatedGpu

DAY_S = 86_400


@pytest.fixture
def gpu(monkeypatch):
    sim = SimulatedGpu()
    sim.install(monkeypatch, torch.cuda)
    monkeypatch.setattr(phases, "_clock", None, raising=False)
    return sim


def test_a_cuda_time_after_a_simulated_day_is_exact_to_the_microsecond(gpu, tmp_path):
    prof = CommProfiler(tmp_path, "stage2_grpo", 0, flush_every_s=3600).start()
    try:
        for _ in range(DAY_S // 600):  # a call every ten minutes, the GPU 3 ms behind the host
            gpu.launch(0.003)
            prof.record("all_reduce", 4, "float32", (0,), None, "nccl", "test")[T_END] = prof._now(True)
            gpu.advance(600)
        gpu.advance(0.987_654_321)  # most of a second after the last call
        gpu.launch(0.002_5)
        call = prof.record("all_reduce", 4, "float32", (0,), None, "nccl", "test")
        call[T_END] = prof._now(True)
        reached_ns = gpu.current.busy_until_ns
    finally:
        prof.stop()
    rows = [json.loads(line) for line in (tmp_path / "rank-00000.jsonl").read_text().splitlines()]
    first, last = rows[0], rows[-1]
    assert last["t_end"] - first["t_start"] > DAY_S  # the stage really ran a day
    assert last["t_end"] == pytest.approx(reached_ns / NS, abs=1e-6)


def test_a_mark_deep_in_the_device_queue_is_timed_from_the_nearest_anchor(gpu):
    clock = DeviceClock(gpu, host_now=gpu.time)
    gpu.launch(40.000_123_456)  # 40 s of work queued: the mark is reached long after later anchors
    mark = clock.mark()
    reached_ns = gpu.default.busy_until_ns
    for _ in range(45):
        gpu.advance(1.0)
        clock.mark()
    assert clock.resolve(mark) == pytest.approx(reached_ns / NS, abs=1e-6)


def test_phase_times_credit_gpu_work_to_the_phase_that_queued_it(gpu):
    phases.take_phase_times()
    with phases.phase("rollout"):
        gpu.launch(2.0)  # the host returns at once
    with phases.phase("reward"):
        gpu.advance(0.25)
        with phases.phase("score"):
            gpu.synchronize()  # waits out the rollout's GPU work
            gpu.launch(0.5)
    times = phases.take_phase_times()
    assert times == pytest.approx({"rollout": 2.0, "reward/score": 0.5, "reward": 0.5}, abs=1e-6)
