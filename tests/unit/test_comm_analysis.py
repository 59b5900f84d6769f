"""Analysis formulas against numbers worked out by hand: nccl-tests' bus bandwidth, the straggler
of a matched call, overlap of async calls."""
from __future__ import annotations

import pytest

from analysis.bandwidth import bus_bandwidth
from analysis.commbench import parse_size
from analysis.matching import match_calls, wait_by_rank
from analysis.overlap import overlap_fraction


@pytest.mark.parametrize("op,n,expected_GBps", [
    ("all_reduce", 8, 2 * 7 / 8 * 8.0),   # 2(n-1)/n * S/t
    ("all_gather", 4, 3 / 4 * 8.0),       # (n-1)/n * S/t
    ("reduce_scatter", 2, 1 / 2 * 8.0),
    ("all_to_all", 16, 15 / 16 * 8.0),
    ("broadcast", 8, 8.0), ("send", 2, 8.0),
])
def test_bus_bandwidth_follows_nccl_tests(op, n, expected_GBps):
    assert bus_bandwidth(op, 8e9, 1.0, n) / 1e9 == pytest.approx(expected_GBps)


def ev(rank, seq, t0, t1, op="all_reduce", async_op=False, ranks=(0, 1, 2)):
    return {"rank": rank, "op": op, "seq": seq, "group_ranks": list(ranks), "t_start": t0, "t_end": t1,
            "phase": "p", "step": 1, "bytes": 8, "async_op": async_op}


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


def test_commbench_sizes_accept_unit_suffixes():
    assert [parse_size(s) for s in ("512", "4K", "1M", "2GB")] == [512, 4096, 1 << 20, 2 << 30]
