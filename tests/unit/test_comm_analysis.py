"""Analysis formulas against numbers worked out by hand: nccl-tests' bus bandwidth, the straggler
of a matched call, overlap of async calls."""

from __future__ import annotations

import json

import pytest

from analysis.bandwidth import bus_bandwidth
from analysis.breakdown import StageSummary, duration
from analysis.events import load_events
from analysis.matching import match_calls, wait_by_rank
from analysis.overlap import overlap_fraction
from launch.commbench import parse_size


@pytest.mark.parametrize(
    "op,n,expected_GBps",
    [
        ("all_reduce", 8, 2 * 7 / 8 * 8.0),  # 2(n-1)/n * S/t
        ("all_gather", 4, 3 / 4 * 8.0),  # (n-1)/n * S/t
        ("reduce_scatter", 2, 1 / 2 * 8.0),
        ("all_to_all", 16, 15 / 16 * 8.0),
        ("broadcast", 8, 8.0),
        ("send", 2, 8.0),
    ],
)
def test_bus_bandwidth_follows_nccl_tests(op, n, expected_GBps):
    assert bus_bandwidth(op, 8e9, 1.0, n) / 1e9 == pytest.approx(expected_GBps)


def ev(rank, seq, t0, t1, op="all_reduce", async_op=False, ranks=(0, 1, 2), step=1, attempt=1):
    return {
        "rank": rank,
        "op": op,
        "seq": seq,
        "group_ranks": list(ranks),
        "t_start": t0,
        "t_end": t1,
        "phase": "p",
        "step": step,
        "bytes": 8,
        "async_op": async_op,
        "attempt": attempt,
    }


def test_a_step_redone_by_a_later_attempt_counts_once_and_seq_restarts_do_not_cross_match(tmp_path):
    # Attempt 1 did steps 1-2 and died during step 3; attempt 2 resumed from the step-1 checkpoint and
    # redid steps 2-3. Each attempt's seq starts at 0, so without the attempt step 1 and the redone
    # step 2 would look like one call.
    def step_call(rank, step, attempt, seq):
        return ev(
            rank,
            seq,
            10.0 * attempt + step,
            10.0 * attempt + step + 0.5,
            ranks=(0, 1),
            step=step,
            attempt=attempt,
        )

    (tmp_path / "profile").mkdir()
    for rank in (0, 1):
        calls = [
            step_call(rank, 1, 1, 0),
            step_call(rank, 2, 1, 1),
            step_call(rank, 2, 2, 0),
            step_call(rank, 3, 2, 1),
        ]
        if rank == 0:
            calls.insert(2, step_call(rank, 3, 1, 2))  # rank 0 got into step 3 before the crash
        (tmp_path / "profile" / f"rank-{rank:05d}.jsonl").write_text(
            "".join(json.dumps(c) + "\n" for c in calls)
        )

    events = load_events(tmp_path)
    assert sorted((e["rank"], e["step"], e["attempt"]) for e in events) == [
        (r, s, a) for r in (0, 1) for s, a in ((1, 1), (2, 2), (3, 2))
    ]
    calls = match_calls(events)
    assert sorted((c.step, c.attempt, c.seq) for c in calls) == [(1, 1, 0), (2, 2, 0), (3, 2, 1)]
    assert all(c.transfer_s == pytest.approx(0.5) for c in calls)


def test_last_arrival_is_the_straggler_and_the_early_ranks_wait_for_it():
    # rank 2 arrives 0.5 s late; all finish together at 2.1
    calls = match_calls([ev(0, 0, 1.0, 2.1), ev(1, 0, 1.2, 2.1), ev(2, 0, 2.0, 2.1)])
    assert len(calls) == 1 and calls[0].slow_rank == 2
    assert wait_by_rank(calls) == pytest.approx({0: 1.0, 1: 0.8, 2: 0.0})
    assert calls[0].transfer_s == pytest.approx(0.1)


def test_calls_missing_on_a_rank_are_not_matched():
    assert match_calls([ev(0, 0, 1, 2), ev(1, 0, 1, 2)]) == []


def test_sync_calls_overlap_nothing_and_async_calls_overlap_outside_blocked_time():
    assert overlap_fraction([ev(0, 0, 0.0, 1.0), ev(0, 1, 2.0, 3.0)]) == 0.0
    # async 0..4, a sync call 1..2 inside it: 3 of the 4 seconds overlapped
    assert overlap_fraction([ev(0, 0, 0.0, 4.0, async_op=True), ev(0, 1, 1.0, 2.0)]) == pytest.approx(0.75)


def test_the_time_a_rank_waits_for_its_async_call_is_not_overlapped():
    waited_from_3 = {**ev(0, 0, 0.0, 4.0, async_op=True), "t_wait": 3.0}
    assert overlap_fraction([waited_from_3]) == pytest.approx(0.75)
    # and with a sync call 1..2 inside it, only 0..1 and 2..3 were free
    assert overlap_fraction([waited_from_3, ev(0, 1, 1.0, 2.0)]) == pytest.approx(0.5)
    waited_at_once = {**ev(0, 0, 0.0, 4.0, async_op=True), "t_wait": 0.0}
    assert overlap_fraction([waited_at_once]) == 0.0


def test_on_cuda_a_call_on_a_side_stream_overlaps_and_time_counts_from_when_its_stream_got_there():
    # A synchronous call on DeepSpeed's reduction stream: the compute stream went on beside it.
    side = {**ev(0, 0, 0.0, 4.0), "side_stream": True}
    assert overlap_fraction([side, ev(0, 1, 1.0, 2.0)]) == pytest.approx(0.75)
    # Enqueued at 0 but reached by its stream at 3: one second in the call, not four.
    queued = {**ev(0, 0, 0.0, 4.0), "t_ready": 3.0}
    assert duration(queued) == pytest.approx(1.0)
    # Matching: rank 1's stream got there last (t_ready 3), though its host enqueued first.
    calls = match_calls(
        [
            {**ev(0, 0, 1.0, 4.0, ranks=(0, 1)), "t_ready": 2.0},
            {**ev(1, 0, 0.5, 4.0, ranks=(0, 1)), "t_ready": 3.0},
        ]
    )
    assert calls[0].slow_rank == 1 and calls[0].wait(0) == pytest.approx(1.0)
    assert calls[0].transfer_s == pytest.approx(1.0)


def test_commbench_sizes_accept_unit_suffixes():
    assert [parse_size(s) for s in ("512", "4K", "1M", "2GB")] == [512, 4096, 1 << 20, 2 << 30]


def test_per_step_figures_leave_out_setup_and_the_final_evaluation():
    def call(rank, step, phase, nbytes, seconds):
        return {**ev(rank, step, 0.0, seconds, ranks=(0, 1), step=step), "phase": phase, "bytes": nbytes}

    # Setup (step 0) broadcasts the weights and the evaluation of final/ (step 3) gathers results:
    # both dwarf the two training steps' 100-byte, 10 ms all-reduces.
    events = [
        call(r, step, phase, nbytes, t)
        for r in (0, 1)
        for step, phase, nbytes, t in (
            (0, "setup", 10**6, 5.0),
            (1, "grad_sync", 100, 0.01),
            (2, "grad_sync", 100, 0.01),
            (3, "eval", 10**5, 1.0),
        )
    ]
    summary = StageSummary("stage1_sft", events, match_calls(events), {})
    assert summary.steps == 2
    assert summary.bytes_per_step() == 100
    assert summary.comm_seconds_per_step() == pytest.approx(0.01)


def test_calls_in_a_group_of_one_do_not_count_toward_bus_bandwidth():
    # megatron's tensor-parallel all-reduce at TP 1: a group of one, no byte crosses a link (bus
    # factor 0); 3 of them per real 2-rank all-reduce must not make the median 0
    def call(rank, seq, ranks):
        return {**ev(rank, seq, 0.0, 1.0, ranks=ranks), "bytes": 10**6, "group_size": len(ranks)}

    alone = [call(r, s, (r,)) for r in (0, 1) for s in range(3)]
    together = [call(r, 0, (0, 1)) for r in (0, 1)]
    events = alone + together
    summary = StageSummary("stage1_sft", events, match_calls(events), {})
    assert summary.median_busbw("all_reduce") == pytest.approx(bus_bandwidth("all_reduce", 10**6, 1.0, 2))


def test_communication_is_broken_down_by_who_made_it_and_what_carried_it():
    def call(rank, seq, op, source, backend, nbytes):
        return {
            **ev(rank, seq, 0.0, 0.002, op=op, ranks=(0, 1)),
            "source": source,
            "backend": backend,
            "bytes": nbytes,
        }

    events = [
        call(r, seq, op, source, backend, nbytes)
        for r in (0, 1)
        for seq, op, source, backend, nbytes in (
            (0, "broadcast", "mpi", "mpi", 29),  # the bootstrap's endpoint
            (1, "broadcast", "torch.distributed", "gloo", 512),
            (2, "broadcast", "torch.distributed", "gloo", 512),
            (0, "all_reduce", "deepspeed", "gloo", 4096),
        )
    ]
    rows = StageSummary("stage1_sft", events, match_calls(events), {}).by_origin()
    assert [row[:5] for row in rows] == [
        ("deepspeed", "gloo", "all_reduce", 1, 4096),
        ("mpi", "mpi", "broadcast", 1, 29),
        ("torch.distributed", "gloo", "broadcast", 2, 1024),
    ]
    assert [row[5] for row in rows] == pytest.approx([0.002, 0.002, 0.004])
