"""The trace parser on a real NCCL trace (torch 2.11 profiler on an H100, NCCL 2.28.9, one rank:
so no ncclDevKernel, and GPU time comes from the `nccl:` GPU annotations where the trace has them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.trace_parser import parse_trace

FIXTURE = Path(__file__).parent / "fixtures" / "nccl_trace_h100_torch211.json"


def test_nccl_trace_gives_each_collective_with_its_size_group_and_order():
    events = parse_trace(FIXTURE, stage="stage2_grpo")
    four_mib = (1 << 20) * 4  # 1M float32 elements each, as the capture script issued them
    assert [(e["op"], e["bytes"], e["dtype"], e["group_ranks"], e["seq"]) for e in events] == [
        ("all_reduce", four_mib, "float32", [0], 0),
        ("all_gather", four_mib, "float32", [0], 0),
        ("reduce_scatter", four_mib, "float32", [0], 0),
        ("broadcast", four_mib, "float32", [0], 0),
        ("all_reduce", four_mib, "float32", [0], 1),
    ]
    assert all(
        e["backend"] == "nccl" and e["source"] == "trace" and e["stage"] == "stage2_grpo" for e in events
    )


def test_nccl_times_come_from_the_gpu_annotation_when_present():
    trace = json.loads(FIXTURE.read_text())
    gpu = next(
        e
        for e in trace["traceEvents"]
        if e.get("cat") == "gpu_user_annotation" and e["name"] == "nccl:_all_gather_base"
    )
    gathered = next(e for e in parse_trace(FIXTURE) if e["op"] == "all_gather")
    assert gathered["t_end"] - gathered["t_start"] == pytest.approx(
        gpu["dur"] / 1e6, abs=5e-7
    )  # doubles near 1.8e9 s resolve ~0.24 us
    assert gathered["t_start"] == pytest.approx((gpu["ts"] * 1e3 + trace["baseTimeNanoseconds"]) / 1e9)
