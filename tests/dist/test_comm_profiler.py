"""The communication profiler on real ranks: every kind of call is recorded with the size it moves,
training traffic equals what the gradients require, DeepSpeed's own comms logger agrees, MPI calls
show up, and a rank made slow on purpose is named as the straggler."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from analysis.breakdown import summarise_stage
from analysis.events import load_events, read_jsonl
from runtime.mpi_profiler import pickled_size
from tests.conftest import REPO, SMALL_RUN, hpcr1_run, run_torchrun
from tests.support.system_packages import system_command

pytestmark = pytest.mark.dist
WORKERS = Path(__file__).parent / "workers"


def run_worker(name: str, stage_dir: Path) -> list[dict]:
    run_torchrun(
        WORKERS / name,
        2,
        str(stage_dir / "profile"),
        env={"TORCH_EXTENSIONS_DIR": str(REPO / ".torch_extensions")},
    )
    return load_events(stage_dir)


@pytest.fixture(scope="module")
def ops_run(tmp_path_factory) -> tuple[list[dict], dict]:
    stage = tmp_path_factory.mktemp("ops") / "stage"
    events = run_worker("comm_ops.py", stage)
    return events, json.loads((stage / "profile" / "reference.json").read_text())


N_BYTES = 1000 * 4  # comm_ops.py: 1000 float32
EXPECTED = {  # phase -> (op, bytes S as nccl-tests counts it on 2 ranks)
    "all_reduce": ("all_reduce", N_BYTES),
    "all_reduce_imported_early": ("all_reduce", N_BYTES),
    "all_reduce_async": ("all_reduce", N_BYTES),
    "all_gather": ("all_gather", 2 * N_BYTES),
    "all_gather_into_tensor": ("all_gather", 2 * N_BYTES),
    "reduce_scatter_tensor": ("reduce_scatter", N_BYTES),
    "broadcast": ("broadcast", N_BYTES),
    "all_to_all_single": ("all_to_all", N_BYTES),
    "barrier": ("barrier", 0),
    "functional_all_reduce": ("all_reduce", N_BYTES),
}


def test_every_kind_of_call_is_recorded_once_with_its_size(ops_run):
    events, _ = ops_run
    for rank in (0, 1):
        mine = [e for e in events if e["rank"] == rank]
        for phase, expected in EXPECTED.items():
            assert [(e["op"], e["bytes"]) for e in mine if e["phase"] == phase] == [expected], phase
        p2p = {
            (e["phase"], e["op"], e["bytes"], e["peer"])
            for e in mine
            if e["phase"] in ("send_recv", "isend_irecv")
        }
        op, peer = ("send", 1) if rank == 0 else ("recv", 0)
        assert p2p == {("send_recv", op, N_BYTES, peer), ("isend_irecv", op, N_BYTES, peer)}


def test_calls_in_inference_mode_and_batched_p2p_are_recorded(ops_run):
    events, _ = ops_run
    for rank in (0, 1):
        mine = [e for e in events if e["rank"] == rank]
        inference = [(e["op"], e["bytes"]) for e in mine if e["phase"] == "inference_mode"]
        assert inference == [
            ("all_reduce", N_BYTES),
            ("all_gather", 2 * N_BYTES),
            ("broadcast", N_BYTES),
            ("barrier", 0),
            ("all_reduce", N_BYTES),
        ]
        batched = [(e["op"], e["bytes"], e["peer"]) for e in mine if e["phase"] == "batch_isend_irecv"]
        assert batched == [(("send", "recv")[rank], N_BYTES, 1 - rank)]


def test_a_work_without_future_completes_when_that_work_is_waited_on(ops_run):
    """Rank 0 waits on its second send first and on the first 0.3 s later: matching waits by kind
    (the oldest pending send) would swap the two completions."""
    events, _ = ops_run
    sends = [e for e in events if e["rank"] == 0 and e["phase"] == "waited_out_of_order"]
    small, large = sorted(sends, key=lambda e: e["bytes"])
    assert (small["bytes"], large["bytes"]) == (N_BYTES // 2, N_BYTES)
    assert small["t_end"] - large["t_end"] >= 0.25


def test_every_call_has_completion_after_start_and_matches_across_ranks(ops_run):
    events, _ = ops_run
    assert all(e["t_end"] >= e["t_start"] for e in events)
    functional = [e for e in events if e["phase"] == "functional_all_reduce"]
    assert functional and all(e["t_start"] <= e["t_wait"] <= e["t_end"] for e in functional)
    keys = [
        Counter(
            (e["op"], tuple(e["group_ranks"]), e["seq"], e["bytes"])
            for e in events
            if e["rank"] == r and e["op"] not in ("send", "recv")
        )
        for r in (0, 1)
    ]
    assert keys[0] == keys[1]


def per_step(events: list[dict], phase: str, op: str) -> dict[int, int]:
    steps: Counter = Counter()
    for e in events:
        if e["rank"] == 0 and e["phase"] == phase and e["op"] == op:
            steps[e["step"]] += e["bytes"]
    return dict(steps)


def test_ddp_all_reduce_bytes_per_step_equal_gradient_bytes(ops_run):
    events, reference = ops_run
    assert per_step(events, "ddp", "all_reduce") == {s: reference["grad_bytes"] for s in (1, 2, 3)}


def test_fsdp2_reduce_scatter_and_all_gather_bytes_per_step_equal_padded_parameter_bytes(ops_run):
    events, reference = ops_run
    padded = reference["padded_grad_bytes"]
    assert reference["grad_bytes"] <= padded < reference["grad_bytes"] * 1.1
    assert per_step(events, "fsdp2", "reduce_scatter") == {s: padded for s in (4, 5, 6)}
    assert per_step(events, "fsdp2", "all_gather") == {s: padded for s in (4, 5, 6)}


# DeepSpeed's comms logger names ops after its API and sizes all_gather by the piece sent.
DEEPSPEED_NAMES = {
    "all_gather_into_tensor": ("all_gather", 2),
    "reduce_scatter_tensor": ("reduce_scatter", 1),
}


def test_deepspeed_calls_agree_with_deepspeeds_comms_logger(tmp_path):
    events = run_worker("comm_deepspeed.py", tmp_path / "stage")
    for rank in (0, 1):
        logged = json.loads((tmp_path / "stage" / "profile" / f"comms_logger-{rank}.json").read_text())
        theirs = Counter()
        for name, sizes in logged.items():
            op, pieces = DEEPSPEED_NAMES.get(name, (name, 1))
            for size, count in sizes.items():
                theirs[(op, int(size) * pieces)] += count
        ours = Counter(
            (e["op"], e["bytes"]) for e in events if e["rank"] == rank and e["source"] == "deepspeed"
        )
        assert ours == theirs and sum(ours.values()) > 0


def test_straggler_is_named_and_the_other_rank_carries_the_wait(tmp_path):
    """Rank 1 sleeps 0.3 s before each of 3 all-reduces, counted from rank 0's arrival at the call
    (workers/comm_straggler.py), so load cannot make rank 0 the later one. Rank 0 then waits 0.3 s a
    call less only the instants between its marker and its call: half of it is a bound load cannot
    break, and wait read off completion times (about equal on both ranks) would still fail it."""
    stage = tmp_path / "stage1_sft"
    run_worker("comm_straggler.py", stage)
    # rank -> (rank, comm, wait, times slowest, overlap)
    ranks = {r[0]: r for r in summarise_stage(stage).per_rank()}
    assert ranks[1][3] == 3 and ranks[0][3] == 0, "rank 1 slept before each of the 3 calls"
    assert ranks[0][2] >= 3 * 0.3 / 2 and ranks[1][2] == 0.0, "rank 1 arrived last: it waited for nobody"


def test_mpi_calls_are_recorded_with_their_sizes(tmp_path):
    cmd = [
        system_command("mpirun"),
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        "2",
        sys.executable,
        str(WORKERS / "comm_mpi.py"),
        str(tmp_path / "stage" / "profile"),
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    events = load_events(tmp_path / "stage")
    doubles = 1000 * 8
    for rank in (0, 1):
        seen = {e["phase"]: (e["op"], e["bytes"], e["source"]) for e in events if e["rank"] == rank}
        assert seen["Allreduce"] == seen["Allreduce_in_place"] == ("all_reduce", doubles, "mpi")
        assert seen["Bcast"] == ("broadcast", doubles, "mpi")
        assert seen["Allgather"] == ("all_gather", 2 * doubles, "mpi")
        assert seen["Gather"] == ("gather", 2 * doubles, "mpi")
        assert seen["Send_Recv"] == (("send", "recv")[rank], doubles, "mpi")
        assert seen["Barrier"] == ("barrier", 0, "mpi")
        assert seen["bcast_object"][1] > 0
        assert seen["allgather_object"] == ("all_gather", pickled_size("x") + pickled_size("xx"), "mpi")


def test_gloo_trace_parses_to_the_events_the_profiler_recorded(tmp_path):
    from runtime.trace_parser import parse_trace

    events = run_worker("comm_trace.py", tmp_path / "stage")
    for rank in (0, 1):
        parsed = parse_trace(tmp_path / "stage" / "profile" / f"trace-rank{rank}.json", stage="trace")
        recorded = [e for e in events if e["rank"] == rank]
        fields = ("phase", "op", "bytes", "dtype", "group_ranks", "seq")
        assert [tuple(e[f] for f in fields) for e in parsed] == [
            tuple(e[f] for f in fields) for e in recorded
        ]
        # Same clock: the trace's base time is wall-clock. A different clock would be off by far more
        # than the 20 ms a loaded 2-core machine can put between the trace's stamp and ours.
        for p, r in zip(parsed, recorded):
            assert abs(p["t_start"] - r["t_start"]) < 0.02 and abs(p["t_end"] - r["t_end"]) < 0.02


def test_commbench_writes_latency_and_bus_bandwidth_per_op_and_size(tmp_path):
    out = tmp_path / "commbench.json"
    # --nproc given explicitly: torchrun once refused it as an ambiguous prefix of its own option.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.commbench",
            "--nproc",
            "2",
            "--sizes",
            "1K,64K",
            "--iters",
            "3",
            "--warmup",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    bench = json.loads(out.read_text())
    assert bench["world_size"] == 2 and bench["backend"] == "gloo"  # auto, on a node without GPUs
    assert set(bench["results"]) == {
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "broadcast",
        "all_to_all",
        "send_recv",
    }
    for op, rows in bench["results"].items():
        assert [r["bytes"] for r in rows] == [1024, 65536]
        for r in rows:  # busbw = algbw * factor, algbw = S / latency
            assert r["algbw_GBps"] == pytest.approx(r["bytes"] / (r["latency_us"] * 1e-6) / 1e9)
            factor = {"all_reduce": 1.0, "broadcast": 1.0, "send_recv": 1.0}.get(op, 0.5)
            assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor)


def test_async_op_is_recorded_as_the_caller_made_the_call(ops_run):
    """c10d's schemas default async_op to True and a boxed call drops arguments equal to their
    defaults: an absent async_op is an async call (the profiler used to read it as synchronous)."""
    events, _ = ops_run
    flags: dict[tuple[str, str], set[bool]] = {}
    for e in events:
        flags.setdefault((e["phase"], e["op"]), set()).add(e["async_op"])
    assert flags["all_reduce", "all_reduce"] == {False}
    assert flags["broadcast", "broadcast"] == {False}
    assert flags["all_reduce_async", "all_reduce"] == {True}
    assert flags["functional_all_reduce", "all_reduce"] == {True}
    assert flags["ddp", "all_reduce"] == {True}  # DDP's bucketed gradient all-reduce
    # FSDP2 makes both calls with async_op=False (unshard_async_op defaults to False): on GPUs it
    # overlaps them through its own CUDA streams instead
    assert flags["fsdp2", "reduce_scatter"] == flags["fsdp2", "all_gather"] == {False}


def test_a_stage_killed_without_warning_keeps_its_calls_up_to_the_last_flush(tmp_path):
    """SIGKILL leaves no chance to write anything: what the profile holds is what the flusher
    thread appended while the stage ran, up to `profile.flush_every_s` before the kill."""
    config = {**SMALL_RUN, "stage1_sft": {**SMALL_RUN["stage1_sft"], "steps": 2000, "checkpoint_every": 1000}}
    run_dir = tmp_path / "killed"
    proc = hpcr1_run(run_dir, "profile.flush_every_s=1", config=config, wait=False)
    metrics = run_dir / "stage1_sft" / "metrics.jsonl"
    deadline = time.time() + 300
    while (
        proc.poll() is None
        and time.time() < deadline
        and len(read_jsonl(metrics) if metrics.exists() else []) < 20
    ):
        time.sleep(0.1)
    time.sleep(3)  # several flushes into the steps
    os.killpg(proc.pid, signal.SIGKILL)
    killed_at = time.time()
    proc.wait()
    steps_logged = len(read_jsonl(metrics))
    assert 20 <= steps_logged < 2000, "the stage never got going, or finished before the kill"

    for rank in (0, 1):
        events = read_jsonl(run_dir / "stage1_sft" / "profile" / f"rank-{rank:05d}.jsonl")
        last = max(e["t_start"] for e in events)
        assert last >= killed_at - 1 - 1.5, (
            f"rank {rank}: last call kept {killed_at - last:.1f} s before the kill"
        )
        # The steps the profile covers reach the last ones metrics.jsonl logged (a 1 s interval is
        # several steps of this model, so allow for those).
        assert max(e["step"] for e in events) >= steps_logged - 30
