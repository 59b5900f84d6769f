"""One run at a time: a second `hpcr1 run`/`resume` on a run directory in use is refused naming the
holder and changes nothing; the lock outlives a killed driver while its ranks live, and is taken
over (and said so) once every holder is gone."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml

from core.atomic import atomic_write_text
from core.config import dump_config, load_config
from core.rundir import RunDir
from pipeline.cli import main
from pipeline.runlock import RunDirBusy, hold_run_dir, holder_after
from tests.conftest import REPO, SMALL_RUN, snapshot

# The driver's side: take the lock, start a child that inherits it (as torchrun does), report pids.
HOLDER = textwrap.dedent("""
    import subprocess, sys
    from pathlib import Path
    from pipeline.runlock import hold_run_dir
    with hold_run_dir(Path(sys.argv[1])) as fd:
        ranks = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], pass_fds=(fd,))
        print(ranks.pid, flush=True)
        sys.stdin.read()
""")


@pytest.fixture
def holder(tmp_path):
    """A live driver holding tmp_path/run's lock, and the pid of the child it passed the lock to."""
    run = RunDir(tmp_path / "run")
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run.lock)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    ranks_pid = int(proc.stdout.readline())
    yield run, proc, ranks_pid
    for pid in (proc.pid, ranks_pid):
        _kill(pid)
    proc.wait()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_second_run_and_resume_are_refused_naming_the_holder(holder, tmp_path, capsys):
    run, proc, _ = holder
    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump(SMALL_RUN))
    atomic_write_text(run.config, dump_config(load_config(config)))  # what `resume` reads
    before = snapshot(run.root)
    for argv in (["run", str(config), "--run-dir", str(run.root)], ["resume", str(run.root)]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert f"in use by pid {proc.pid} on {socket.gethostname()}" in err, err
        assert "Traceback" not in err
    assert snapshot(run.root) == before


def test_lock_outlives_a_killed_driver_while_its_ranks_live_then_is_taken_over(holder):
    run, proc, ranks_pid = holder
    proc.kill()  # kill -9: no cleanup runs in the driver
    proc.wait()
    with pytest.raises(RunDirBusy, match=f"pid {proc.pid}"):
        with hold_run_dir(run.lock):
            pass
    _kill(ranks_pid)
    wait_gone(ranks_pid)  # the killed driver's child, now init's: not ours to wait for
    notes: list[str] = []
    with hold_run_dir(run.lock, echo=notes.append):
        assert json.loads(run.lock.read_text())["pid"] == os.getpid()
    assert len(notes) == 1 and f"pid {proc.pid}" in notes[0] and "taking it over" in notes[0], notes
    assert run.lock.read_text() == "", "a clean release empties the holder's name"
    with hold_run_dir(run.lock, echo=notes.append):
        pass
    assert len(notes) == 1, "after a clean release there is nothing to take over"


def wait_gone(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z":
                return  # a zombie holds no files
        except FileNotFoundError:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not end")


def test_a_stage_job_waits_for_a_submit_in_progress_then_takes_the_lock(holder):
    # `hpcr1 submit` holds the run directory while it submits the later stages; the first stage's
    # job may already be starting. It waits (up to its grace) instead of failing, and no longer.
    run, proc, ranks_pid = holder
    with pytest.raises(RunDirBusy, match=f"pid {proc.pid}"):
        with hold_run_dir(run.lock, wait_s=0.5):
            pass

    def submit_finishes():
        time.sleep(1.0)
        _kill(ranks_pid)
        proc.stdin.close()

    threading.Thread(target=submit_finishes).start()
    start = time.monotonic()
    with hold_run_dir(run.lock, wait_s=60):
        waited = time.monotonic() - start
        assert json.loads(run.lock.read_text())["pid"] == os.getpid()
    assert 0.9 < waited < 30


def test_holder_after_names_the_holder_until_it_lets_go_and_takes_nothing(holder):
    # `hpcr1 cancel` waits with it for the cancelled stage's processes to end
    run, proc, ranks_pid = holder
    assert f"pid {proc.pid}" in holder_after(run.lock, 0.3)
    threading.Timer(0.5, lambda: (_kill(ranks_pid), proc.stdin.close())).start()
    assert holder_after(run.lock, 30) is None
    proc.wait()
    with hold_run_dir(run.lock, wait_s=0):
        pass
