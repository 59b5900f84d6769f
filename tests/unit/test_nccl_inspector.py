"""NCCL Inspector's dumps read into our events: its operation names mapped to ours, its per-rank message
sizes turned into the whole array S, its microseconds into seconds, the communicator's rank and size;
bad lines and foreign files counted, never a traceback; the report gets the stage's Inspector table.

The fixtures are hand-written in the JSON writer's exact format (NVIDIA/nccl
plugins/profiler/inspector/inspector_json.cc): gpu-a01-pid4242.log is rank 0 without verbose traces (one
record in the NCCL 2.28.3 form, one malformed, one "Invalid" operation, a truncated last line),
gpu-a01-pid4243.log rank 1 with verbose traces; the .prom file is Inspector's Prometheus mode."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from analysis.bandwidth import bus_bandwidth
from analysis.nccl_inspector import TITLE, kernel_seconds, read_stage, summary_table
from analysis.report import write_report
from runtime.comm_profiler import FIELDS
from tests.conftest import markdown_table

FIXTURES = Path(__file__).parent / "fixtures" / "nccl_inspector"
STAGE = "stage2_grpo"
HEADER = ["op", "ranks", "size", "calls (all ranks)", "median kernel time", "median busbw"]


def stage_with_dump(run: Path) -> Path:
    stage = run / STAGE
    shutil.copytree(FIXTURES, stage / "nccl-inspector")
    return stage


@pytest.fixture
def events(tmp_path) -> dict[tuple[int, str], dict]:
    return {(e["rank"], e["op"]): e for e in read_stage(stage_with_dump(tmp_path)).events}


def test_calls_become_events_of_our_schema_with_our_op_names(events):
    assert sorted(events) == [
        (0, "all_gather"),
        (0, "all_reduce"),
        (0, "broadcast"),
        (0, "reduce_scatter"),
        (0, "send"),
        (1, "all_reduce"),
        (1, "recv"),
        (1, "reduce_scatter"),
    ]
    for e in events.values():
        assert set(e) == set(FIELDS)
        assert (e["source"], e["backend"], e["phase"], e["step"]) == ("nccl-inspector", "nccl", "none", None)
        assert e["stage"] == STAGE


def test_sizes_are_the_whole_array_and_rank_and_group_are_the_communicators(events):
    # AllGather's and ReduceScatter's size is one rank's piece (16 MiB) of 8: S = 128 MiB
    assert events[0, "all_gather"]["bytes"] == events[0, "reduce_scatter"]["bytes"] == 134217728
    assert events[0, "all_reduce"]["bytes"] == 268435456 and events[0, "broadcast"]["bytes"] == 1048576
    assert [events[0, "all_reduce"][k] for k in ("rank", "group_size", "seq", "peer")] == [0, 8, 17, None]
    send = events[0, "send"]
    assert [send[k] for k in ("rank", "group_size", "seq", "peer", "bytes")] == [0, 2, 1, 1, 4194304]
    assert [events[1, "recv"][k] for k in ("rank", "group_size", "peer")] == [1, 2, 0]


def test_without_verbose_trace_a_call_ends_when_it_was_dumped(events):
    e = events[0, "all_reduce"]  # dumped at 1750000000500000 us, 2000 us of kernel
    assert e["t_end"] == 1750000000.5 and e["t_start"] == pytest.approx(1750000000.498, abs=1e-7)
    assert kernel_seconds(e) == 0.002


def test_verbose_trace_starts_a_call_at_its_first_kernel_else_at_the_call(events):
    e = events[1, "all_reduce"]  # channels started at ...100130 and ...100125 us; 2100 us of kernel
    assert e["t_start"] == pytest.approx(1750000000.100125, abs=1e-7)
    assert kernel_seconds(e) == 0.0021
    recv = events[1, "recv"]  # no kernel events: the p2p call's start, 1750000000200000 us
    assert recv["t_start"] == 1750000000.2 and kernel_seconds(recv) == 0.0001


def test_a_channel_whose_kernel_start_was_not_seen_does_not_start_the_call(tmp_path):
    record = json.loads((FIXTURES / "gpu-a01-pid4243.log").read_text().splitlines()[0])
    record["coll_perf"]["event_trace_ts"]["kernel_events"][1]["kernel_start_ts"] = 0
    folder = tmp_path / STAGE / "nccl-inspector"
    folder.mkdir(parents=True)
    (folder / "gpu-a01-pid4243.log").write_text(json.dumps(record) + "\n")
    [e] = read_stage(tmp_path / STAGE).events
    assert e["t_start"] == pytest.approx(1750000000.100130, abs=1e-7)  # channel 0's start


def test_our_bus_bandwidth_is_inspectors_own(events):
    """Each fixture line's coll_busbw_gbs / p2p_busbw_gbs: the same S, n and time give the same number."""
    inspectors = {
        (0, "all_reduce"): 234.881024,
        (0, "all_gather"): 117.440512,
        (0, "reduce_scatter"): 93.952410,
        (0, "send"): 41.943040,
        (0, "broadcast"): 20.971520,
        (1, "all_reduce"): 223.696213,
        (1, "recv"): 41.943040,
        (1, "reduce_scatter"): 90.338855,
    }
    ours = {
        key: bus_bandwidth(e["op"], e["bytes"], kernel_seconds(e), e["group_size"]) / 1e9
        for key, e in events.items()
    }
    assert ours == pytest.approx(inspectors, abs=1e-6)


def test_bad_lines_foreign_files_and_unnamed_operations_are_counted(tmp_path):
    dump = read_stage(stage_with_dump(tmp_path))
    assert len(dump.events) == 8
    assert dict(dump.bad_lines) == {"gpu-a01-pid4242.log": 2}  # exec time "fast"; the truncated last line
    assert dump.unknown_files == ["nccl_inspector_metrics_GPU-0a1b2c3d.prom"]
    assert dict(dump.unknown_ops) == {"Invalid": 1}
    assert dump.host_timed == 1  # rank 1's reduce_scatter, collective_cpu


def test_hostile_lines_are_skipped_without_a_traceback(tmp_path):
    good = (FIXTURES / "gpu-a01-pid4242.log").read_text().splitlines()[0]
    record = json.loads(good)
    rank_too_big = {**record, "header": {**record["header"], "rank": 8}}
    bool_seq = {**record, "coll_perf": {**record["coll_perf"], "coll_sn": True}}
    folder = tmp_path / STAGE / "nccl-inspector" / "12345"  # a dump directory per Slurm job
    folder.mkdir(parents=True)
    lines = [good, "[1, 2]", '{"header": {}}', json.dumps(rank_too_big), json.dumps(bool_seq)]
    lines += ["\ufffd\x00", "[" * 10**5]  # a NUL; nesting too deep for the json module
    (folder / "n1-pid1.log").write_text("\n".join(lines) + "\n")
    (folder / "n1-pid2.log").write_text("")  # opened, nothing dumped yet
    (folder / "notes.txt").write_bytes(b"\xff\xfe binary\n")
    dump = read_stage(tmp_path / STAGE)
    assert len(dump.events) == 1 and dict(dump.bad_lines) == {"12345/n1-pid1.log": 6}
    assert dump.unknown_files == ["12345/notes.txt"]
    assert read_stage(tmp_path / "stage1_sft").events == []


def test_table_is_per_op_communicator_size_and_power_of_two_size(events):
    table = summary_table(list(events.values()))
    assert table.header == HEADER
    # all_reduce: 2000 and 2100 us -> 2.050 ms; busbw (234.881024 + 223.696213) / 2
    # reduce_scatter: 1250 and 1300 us -> 1.275 ms; busbw (93.952410 + 90.338855) / 2
    assert table.rows == [
        ["all_gather", "8", "[128.00 MiB, 256.00 MiB)", "1", "1.000 ms", "117.4 GB/s"],
        ["all_reduce", "8", "[256.00 MiB, 512.00 MiB)", "2", "2.050 ms", "229.3 GB/s"],
        ["broadcast", "8", "[1.00 MiB, 2.00 MiB)", "1", "50.00 µs", "20.97 GB/s"],
        ["recv", "2", "[4.00 MiB, 8.00 MiB)", "1", "100.0 µs", "41.94 GB/s"],
        ["reduce_scatter", "8", "[128.00 MiB, 256.00 MiB)", "2", "1.275 ms", "92.15 GB/s"],
        ["send", "2", "[4.00 MiB, 8.00 MiB)", "1", "100.0 µs", "41.94 GB/s"],
    ]


def profile(run: Path, stage: str) -> None:
    """Two ranks' one all-reduce of our own profiler, so that the report lists the stage."""
    folder = run / stage / "profile"
    folder.mkdir(parents=True)
    for rank in (0, 1):
        e = dict.fromkeys(FIELDS)
        e.update(stage=stage, step=1, phase="forward", rank=rank, op="all_reduce", bytes=1 << 20)
        e.update(dtype="float32", group_size=2, group_ranks=[0, 1], seq=0, t_start=10.0, t_end=10.01)
        e.update(backend="nccl", source="torch.distributed", async_op=False, attempt=1)
        (folder / f"rank-{rank:05d}.jsonl").write_text(json.dumps(e) + "\n")


def test_report_shows_the_inspector_table_of_a_stage_that_has_a_dump(tmp_path):
    run = tmp_path / "run"
    profile(run, "stage1_sft")
    profile(run, STAGE)
    stage_with_dump(run)
    write_report([run], tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    sft, grpo = md.split(f"### {STAGE}\n")
    assert TITLE not in sft
    rows = markdown_table(grpo, TITLE)
    assert rows[0] == HEADER
    assert rows[2] == ["all_reduce", "8", "[256.00 MiB, 512.00 MiB)", "2", "2.050 ms", "229.3 GB/s"]
    assert "skipped 2 malformed or truncated lines: gpu-a01-pid4242.log (2)." in grpo
    assert "not read, no Inspector JSON record in them" in grpo and "GPU-0a1b2c3d.prom" in grpo
    assert "left out calls of operations we do not map: Invalid (1)" in grpo
    assert "1 of the calls were timed on the host" in grpo
    assert TITLE in (tmp_path / "report" / "index.html").read_text()
