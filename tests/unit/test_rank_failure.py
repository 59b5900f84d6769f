"""Which rank failed first, from what the ranks and torchrun leave in logs/, in the orders of events
that the 2-rank tests (tests/dist/test_rank_failure.py) cannot force: two ranks ending within one
torchrun poll, and a survivor that outlives torchrun's SIGTERM."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from runtime.rank_failure import (
    FAIL_AT_ENV,
    TORCHRUN_FAILURES,
    InjectedFailure,
    fail_if_asked,
    forget_failures,
    read_failures,
    record_exit,
    record_path,
    record_printed_exception,
    stage_error,
)


def write_logs(log_dir, exits: list[tuple[int, int, str | None, int]], raised: dict[int, tuple[float, str]]):
    """exits: (rank, exit code, signal, torchrun's timestamp) in the order torchrun saw them end;
    raised: rank -> (time, message) of a RuntimeError the rank recorded."""
    log_dir.mkdir(exist_ok=True)
    ended = [{"rank": r, "exitcode": code, "signal": sig, "timestamp": ts} for r, code, sig, ts in exits]
    (log_dir / TORCHRUN_FAILURES).write_text(json.dumps(ended))
    for rank, (t, message) in raised.items():
        record = {"rank": rank, "time": t, "type": "RuntimeError", "message": message, "traceback": ""}
        record_path(log_dir, rank).write_text(json.dumps(record))


def test_killed_rank_is_first_though_its_survivor_ended_in_the_same_poll(tmp_path):
    write_logs(
        tmp_path, [(0, 1, None, 100), (1, -9, "SIGKILL", 100)], {0: (100.05, "Connection closed by peer")}
    )
    error = stage_error(tmp_path, 1)
    assert (error["rank"], error["signal"], error["exception"]) == (1, "SIGKILL", None)
    assert error["others"] == {"0": "RuntimeError: Connection closed by peer"}


def test_a_forked_rank_killed_is_first_though_torchrun_reported_only_its_survivor(tmp_path, monkeypatch):
    # torchrun's forkserver mode reports the first rank it finds ended; both had ended at its poll.
    write_logs(tmp_path, [(0, 1, None, 100)], {0: (100.05, "Connection closed by peer")})
    for rank, code, t in [(1, -9, 100.02), (0, 1, 100.06)]:
        monkeypatch.setattr("time.time", lambda t=t: t)
        record_exit(tmp_path, rank, code)
    error = stage_error(tmp_path, 1)
    assert (error["rank"], error["signal"], error["exception"]) == (1, "SIGKILL", None)
    assert error["others"] == {"0": "RuntimeError: Connection closed by peer"}


def test_earliest_exception_is_first_though_torchrun_saw_its_rank_end_later(tmp_path):
    write_logs(
        tmp_path,
        [(0, 1, None, 100), (1, 1, None, 100)],
        {0: (100.3, "Connection closed by peer"), 1: (100.01, "out of memory")},
    )
    error = stage_error(tmp_path, 1)
    assert (error["rank"], error["message"]) == (1, "out of memory")


def test_survivor_killed_after_the_sigterm_grace_is_not_the_cause(tmp_path):
    write_logs(tmp_path, [(1, 1, None, 100), (0, -9, "SIGKILL", 131)], {1: (99.9, "bad batch")})
    assert stage_error(tmp_path, 1)["rank"] == 1


def test_rank_stopped_by_torchruns_sigterm_is_a_bystander(tmp_path):
    write_logs(tmp_path, [(0, -15, "SIGTERM", 100), (1, -11, "SIGSEGV", 100)], {})
    error = stage_error(tmp_path, 1)
    assert error["rank"] == 1 and error["summary"].startswith("rank 1 failed first: killed by SIGSEGV")


def test_no_record_from_any_rank_says_so(tmp_path):
    error = stage_error(tmp_path, 1)
    assert error["rank"] is None and error["summary"].startswith(
        "ranks exited with code 1; no rank recorded why"
    )


CRASH_AT_STEP = """
import faulthandler, sys
from pathlib import Path
from runtime.rank_failure import record_crashes

def train_step():
    faulthandler._sigsegv()  # a segfault in native code, as a bad kernel or library makes one

record_crashes(Path(sys.argv[1]), 1)
train_step()
"""


def test_a_crashed_rank_is_named_with_the_python_line_it_crashed_under(tmp_path):
    """Under srun nothing but the rank itself can say why it ended: a segfault leaves faulthandler's
    stack, not "no rank recorded why"."""
    crashed = subprocess.run([sys.executable, "-c", CRASH_AT_STEP, str(tmp_path)], capture_output=True)
    assert crashed.returncode == -11, crashed
    error = stage_error(tmp_path, 139)
    assert error["rank"] == 1 and error["exception"] == "Fatal Python error", error
    assert error["summary"].startswith("rank 1 failed first: Fatal Python error: Segmentation fault in File")
    assert "line 7 in train_step" in error["message"], error


def test_a_crash_dump_cut_short_still_names_its_rank(tmp_path):
    (tmp_path / "rank-00001.fatal.txt").write_text("\n")
    error = stage_error(tmp_path, 139)
    assert error["rank"] == 1 and error["message"] == "unknown crash in no Python frame", error


def test_an_earlier_attempts_records_are_forgotten(tmp_path):
    write_logs(tmp_path, [(1, -9, "SIGKILL", 100)], {0: (100.05, "Connection closed by peer")})
    (tmp_path / "rank-00001.fatal.txt").write_text("Fatal Python error: Aborted\n")
    record_exit(tmp_path, 1, -9)
    forget_failures(tmp_path)
    assert stage_error(tmp_path, 1)["rank"] is None


def test_failpoint_raises_only_on_its_rank_and_step(monkeypatch):
    monkeypatch.setenv(FAIL_AT_ENV, "rank=1,step=3")
    fail_if_asked(0, 3)  # another rank
    fail_if_asked(1, 2)  # another step
    with pytest.raises(InjectedFailure, match="rank 1 fails as step 3 begins"):
        fail_if_asked(1, 3)


# The end of main_ppo's output when one of verl's FSDP ranks was killed (Ray's driver traceback).
VERL_OUTPUT = """\
(TaskRunnerV1 pid=101) INFO: step 2 started
Traceback (most recent call last):
  File "verl/trainer/main_ppo.py", line 93, in run_ppo
    ray.get(runner.run.remote(config))
ray.exceptions.RayTaskError(ActorDiedError): ray::TaskRunnerV1.run() (pid=101, ip=10.0.0.1)
  File "verl/trainer/ppo/v1/trainer_base.py", line 485, in fit
ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.
\tclass_name: create_colocated_worker_cls.<locals>.WorkerDict
\tactor_id: 2b42555fcb9dc220fca0130b05000000
\tpid: 20272
Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.
"""


def test_what_a_child_process_printed_last_is_recorded_as_the_ranks_failure(tmp_path):
    assert record_printed_exception(tmp_path, 0, VERL_OUTPUT)
    _, records = read_failures(tmp_path)
    assert records[0]["type"] == "ActorDiedError"
    assert "WorkerDict" in records[0]["message"] and "pid: 20272" in records[0]["message"]
    assert stage_error(tmp_path, 1)["exception"] == "ActorDiedError"
    assert not record_printed_exception(tmp_path / "other", 0, "no exception here\n")


def waiting(rank: int, op: str, seq: int, t_start: float, group=(0, 1, 2)) -> dict:
    return {
        "rank": rank,
        "op": op,
        "seq": seq,
        "group_ranks": list(group),
        "phase": "update",
        "step": 7,
        "t_start": t_start,
        "waited_s": 1000 - t_start,
        "stack": f'  File "stages/x.py", line {rank}, in f\n',
    }


def test_a_deadlock_names_the_call_waited_in_longest_and_where_each_absent_rank_was(tmp_path):
    """Ranks 0 and 1 wait in all_reduce #4; rank 2 waits in another call (a deadlock) and rank 3,
    outside the group, is not asked about. The error names the call and rank 2's own."""
    from runtime.hang_watch import stack_path, waiting_path

    write_logs(
        tmp_path,
        [(1, 1, None, 1001), (0, 1, None, 1001)],
        {0: (1000.5, "Timed out"), 1: (1000.6, "Timed out")},
    )
    for rank, op, seq, t in [
        (0, "all_reduce", 4, 400.0),
        (1, "all_reduce", 4, 410.0),
        (2, "broadcast", 9, 420.0),
    ]:
        waiting_path(tmp_path, rank).write_text(json.dumps(waiting(rank, op, seq, t)))
    stack_path(tmp_path, 2).write_text("a stale dump: rank 2 wrote its own record since")
    error = stage_error(tmp_path, 1)
    hang = error["hang"]
    assert (hang["op"], hang["seq"], hang["reached"], hang["missing"]) == ("all_reduce", 4, [0, 1], [2])
    assert hang["waited_s"] == 600 and hang["stacks"]["2"] == waiting(2, "broadcast", 9, 420.0)["stack"]
    assert error["summary"].startswith(
        "all_reduce #4 (phase update, step 7) did not end: rank(s) 0, 1 waited 600 s in it, rank(s) 2 never "
        "reached it; rank 2 was waiting in broadcast #9 (phase update, step 7) (log: "
    ), error["summary"]


def test_a_rank_that_failed_first_of_its_own_keeps_the_summary_and_the_hang_is_kept_beside(tmp_path):
    from runtime.hang_watch import stack_path, waiting_path

    write_logs(
        tmp_path, [(1, 1, None, 1001), (0, 1, None, 1001)], {1: (999.0, "out of memory"), 0: (1000.5, "x")}
    )
    waiting_path(tmp_path, 0).write_text(json.dumps(waiting(0, "all_gather", 2, 400.0, group=(0, 1))))
    stack_path(tmp_path, 1).write_text(
        'Process 5: python\n\nThread 5 (idle): "MainThread"\n    step (stages/sft.py:10)\n'
    )
    error = stage_error(tmp_path, 1)
    assert error["summary"].startswith("rank 1 failed first: RuntimeError: out of memory"), error["summary"]
    assert error["hang"]["missing"] == [1] and "step (stages/sft.py:10)" in error["hang"]["stacks"]["1"]
    forget_failures(tmp_path)
    assert not list(tmp_path.glob("rank-*.waiting.json")) and not list(tmp_path.glob("rank-*.stack.txt"))
