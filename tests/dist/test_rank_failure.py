"""One rank of a 2-rank SFT stage fails, by an exception or by SIGKILL (also the generator of a GRPO
stage whose rollout has a rank of its own): every rank is gone within a bound (none left blocked in
a collective or waiting for a batch), and the manifest and `hpcr1 status` name that rank and how it
failed. That the next `hpcr1 run` resumes such a failed stage from its checkpoint, to the
uninterrupted run's losses and weights, is test_sft_stage.py's (beside its uninterrupted run)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from runtime.rank_failure import FAIL_AT_ENV
from tests.conftest import REPO, hpcr1_env, hpcr1_run

pytestmark = [pytest.mark.dist, pytest.mark.slow]

# The failed rank is gone at once (killed, or launch.worker's os._exit after an exception); torchrun
# sees that within its 0.1 s monitor interval, sends SIGTERM to the others and SIGKILL 30 s later
# (torch/distributed/elastic/multiprocessing/api.py, MultiprocessContext._close); the rest is slack
# for a loaded 2-core machine.
ALL_RANKS_GONE_WITHIN_S = 60


def rank_pids(run_dir: Path) -> dict[int, int]:
    """The processes of run_dir's ranks by RANK: those whose stdout is a rank log of the run
    (launch.worker's first act), whichever launcher started them; not a child that inherited it."""
    found = {}
    for proc in psutil.process_iter():
        try:
            out = os.readlink(f"/proc/{proc.pid}/fd/1")
            parent_out = os.readlink(f"/proc/{proc.ppid()}/fd/1")
        except (OSError, psutil.Error):  # one of another user, or one that just ended
            continue
        log = Path(out)
        if log.is_relative_to(run_dir) and log.name.startswith("rank-") and parent_out != out:
            found[int(log.name.removeprefix("rank-").split(".")[0])] = proc.pid
    return found


def wait_until(condition, proc: subprocess.Popen, what: str, timeout: float = 300):
    deadline = time.time() + timeout
    while not (result := condition()):
        if proc.poll() is not None or time.time() > deadline:
            pytest.fail(f"no {what} (hpcr1 run rc={proc.poll()}):\n{proc.communicate()[0].decode()[-4000:]}")
        time.sleep(0.05)
    return result


def gone_at(pids: dict[int, int], timeout: float = 300) -> float:
    """When the last of these processes ended."""
    deadline = time.time() + timeout
    while any(Path(f"/proc/{pid}").exists() for pid in pids.values()):
        assert time.time() < deadline, f"ranks {pids} still running after {timeout} s"
        time.sleep(0.05)
    return time.time()


def failed_run(run_dir: Path, proc: subprocess.Popen, sid: str = "stage1_sft") -> tuple[dict, str]:
    """The stage's manifest entry and `hpcr1 status` once the failed `hpcr1 run` has ended."""
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 1, out[-4000:]
    status = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "status", str(run_dir)],
        cwd=REPO,
        env=hpcr1_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads((run_dir / "manifest.json").read_text())["stages"][sid], status


# The runs end at their fault: steps they never reach cost nothing, and so many that the kill below
# cannot come after the last (it waits for a first step logged, not for a step number).
UNREACHED_STEPS = "stage1_sft.steps=1000"


# stage2_grpo alone, from the base model, its rollout on rank 1 a step ahead of the trainer on rank 0
SPLIT_GRPO = (
    *("--only", "stage2_grpo", "stage2_grpo.init_from=base", "stage2_grpo.steps=1000"),
    *("stage2_grpo.rollout_ranks=1", "stage2_grpo.data_parallel=ddp", "stage2_grpo.prompts_per_step=4"),
    *("stage2_grpo.group_size=2", "stage2_grpo.max_new_tokens=16"),
)
STAGES = {
    "sft": ("stage1_sft", (UNREACHED_STEPS,), "stages.sft"),
    "split grpo": ("stage2_grpo", SPLIT_GRPO, "stages.grpo.trainer"),
}


def steps_logged(run_dir: Path, sid: str = "stage1_sft") -> int:
    metrics = run_dir / sid / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def test_exception_on_rank_1_fails_the_stage_naming_it(tmp_path):
    run_dir = tmp_path / "raises"
    # Step 2: rank 0 is then in step 2's collectives, waiting for a rank that is gone.
    proc = hpcr1_run(run_dir, UNREACHED_STEPS, wait=False, env={FAIL_AT_ENV: "rank=1,step=2"})
    pids = wait_until(lambda: len(rank_pids(run_dir)) == 2 and rank_pids(run_dir), proc, "2 ranks")
    ended = gone_at(pids)
    entry, status = failed_run(run_dir, proc)

    raised = json.loads((run_dir / "stage1_sft" / "logs" / "rank-00001.error.json").read_text())["time"]
    print(f"exception on rank 1 -> all ranks gone: {ended - raised:.1f} s")
    assert ended - raised < ALL_RANKS_GONE_WITHIN_S
    error = entry["error"]
    assert entry["state"] == "failed" and error["rank"] == 1, error
    assert error["exception"] == "InjectedFailure" and "step 2" in error["message"], error
    assert error["log"].endswith("rank-00001.log") and error["signal"] is None
    assert "rank 1 failed first: InjectedFailure" in status, status


@pytest.mark.parametrize("kind", sorted(STAGES))
def test_sigkill_of_rank_1_fails_the_stage_naming_it(tmp_path, kind):
    sid, overrides, module = STAGES[kind]
    run_dir = tmp_path / "killed"
    proc = hpcr1_run(run_dir, *overrides, wait=False)
    pids = wait_until(lambda: len(rank_pids(run_dir)) == 2 and rank_pids(run_dir), proc, "2 ranks")
    wait_until(lambda: steps_logged(run_dir, sid) >= 1, proc, "a step logged (the ranks are training)")
    # Forked (through a parent that records how it ends) from one process that had imported the
    # stage's modules (launch/torchrun.py).
    servers = {psutil.Process(pid).parents()[1] for pid in pids.values()}
    assert len(servers) == 1
    assert servers.pop().environ().get("HPCR1_PRELOAD") == f"launch.worker,{module}"
    os.kill(pids[1], signal.SIGKILL)
    killed = time.time()
    ended = gone_at(pids)
    entry, status = failed_run(run_dir, proc, sid)

    print(f"SIGKILL of rank 1 -> all ranks gone: {ended - killed:.1f} s")
    assert ended - killed < ALL_RANKS_GONE_WITHIN_S
    error = entry["error"]
    assert entry["state"] == "failed" and error["rank"] == 1 and error["signal"] == "SIGKILL", error
    assert "rank 1 failed first: killed by SIGKILL" in status, status


# Colocated GRPO from the base model: rollout and update on both ranks.
GRPO = (
    *("--only", "stage2_grpo", "stage2_grpo.init_from=base", "stage2_grpo.steps=1000"),
    *("stage2_grpo.prompts_per_step=4", "stage2_grpo.group_size=2", "stage2_grpo.max_new_tokens=16"),
)
HUNG = {"sft": ("stage1_sft", (UNREACHED_STEPS,)), "grpo": ("stage2_grpo", GRPO)}
COLLECTIVE_TIMEOUT_S = 20


def profile_events(path: Path) -> list[dict]:
    """A rank's recorded calls; none where it was stopped before its first flush."""
    return [json.loads(line) for line in path.open()] if path.exists() else []


@pytest.mark.parametrize("kind", sorted(HUNG))
def test_a_stopped_rank_fails_the_stage_naming_the_collective_and_the_stopped_ranks_stack(tmp_path, kind):
    """SIGSTOP of rank 1 mid-stage: rank 0 waits in its next collective until the timeout, and the
    error names that call (op, phase, step, sequence number), rank 0 as having reached it and rank 1
    as not, with rank 1's Python stack read from outside; every rank is gone within the bound."""
    sid, overrides = HUNG[kind]
    run_dir = tmp_path / "stopped"
    env = {"HPCR1_COLLECTIVE_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S)}
    proc = hpcr1_run(run_dir, *overrides, wait=False, env=env)
    pids = wait_until(lambda: len(rank_pids(run_dir)) == 2 and rank_pids(run_dir), proc, "2 ranks")
    wait_until(lambda: steps_logged(run_dir, sid) >= 1, proc, "a step logged (the ranks are training)")
    os.kill(pids[1], signal.SIGSTOP)
    stopped = time.time()
    ended = gone_at(pids)
    entry, status = failed_run(run_dir, proc, sid)

    print(f"SIGSTOP of rank 1 -> all ranks gone: {ended - stopped:.1f} s")
    assert ended - stopped < COLLECTIVE_TIMEOUT_S + ALL_RANKS_GONE_WITHIN_S
    hang = entry["error"]["hang"]
    assert (hang["reached"], hang["missing"], hang["group_ranks"]) == ([0], [1], [0, 1]), hang
    assert hang["waited_s"] >= COLLECTIVE_TIMEOUT_S / 2
    # The call is in rank 0's profile, ended only by its timeout, and never began on rank 1.
    calls = {r: profile_events(run_dir / sid / "profile" / f"rank-{r:05d}.jsonl") for r in (0, 1)}
    call = (hang["op"], hang["seq"], hang["group_ranks"])
    [waited] = [e for e in calls[0] if (e["op"], e["seq"], e["group_ranks"]) == call]
    assert waited["t_end"] is None or waited["t_end"] - waited["t_start"] >= 0.9 * COLLECTIVE_TIMEOUT_S
    assert (waited["phase"], waited["step"]) == (hang["phase"], hang["step"])
    assert not [e for e in calls[1] if (e["op"], e["seq"], e["group_ranks"]) == call]
    assert hang["step"] >= 1
    # rank 1's stack, taken by py-spy while it was stopped: its main thread in the stage's code
    assert '"MainThread"' in hang["stacks"]["1"] and "stages/" in hang["stacks"]["1"], hang["stacks"]["1"]
    words = f"{hang['op']} #{hang['seq']} (phase {hang['phase']}, step {hang['step']}) did not end"
    assert entry["error"]["summary"].startswith(words), entry["error"]["summary"]
    assert "rank(s) 0 waited" in status and "rank(s) 1 never reached it; rank 1 was at " in status, status
