"""A collective that does not end names itself, the ranks that reached it and the stacks of those
that did not.

Each rank's watch (a thread beside the communication profiler) writes logs/rank-N.waiting.json once
the rank's oldest open call has run half the collective timeout: the call (op, phase, step, its
sequence number in its group, the group) and the rank's own Python stack, rewritten while it waits
and removed when it ends. A rank that never reached the call (stopped, deadlocked elsewhere, stuck in
a file system) cannot write anything, so each rank also starts a small process of its own,
`python -m runtime.hang_watch LOG_DIR RANK PID`, that watches the other ranks' records: while one
stands and its rank writes none, it dumps its rank's stack with py-spy, which reads a stopped or
stuck process from outside, to logs/rank-N.stack.txt. Whatever the launcher (torchrun, srun,
mpirun), on whichever node. When the timeout ends the stage, `hang_error` reads both back for the
manifest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

from core.atomic import atomic_write_text
from runtime.linux import die_with_parent, let_trace

# torch's own bounds where the profile sets none (torch.distributed.constants): 30 min gloo, 10 min NCCL.
DEFAULT_TIMEOUT = {"gloo": timedelta(minutes=30), "nccl": timedelta(minutes=10)}


def waiting_path(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank-{rank:05d}.waiting.json"


def stack_path(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank-{rank:05d}.stack.txt"


def report_after_s(timeout: timedelta | None, backend: str) -> float:
    """How long a call runs before the rank reports it: half its timeout, so that the stacks are
    taken before the timeout ends the stage."""
    return (timeout or DEFAULT_TIMEOUT.get(backend, DEFAULT_TIMEOUT["gloo"])).total_seconds() / 2


class HangWatch:
    """The rank-side watch: `with HangWatch(profiler, log_dir, rank, after_s): ...`."""

    def __init__(self, profiler, log_dir: Path, rank: int, after_s: float):
        self.profiler, self.after_s = profiler, after_s
        self.path = waiting_path(log_dir, rank)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watch", daemon=True)

    def __enter__(self) -> HangWatch:
        self._thread.start()
        return self

    def __exit__(self, exc_type, *_) -> None:
        self._stop.set()
        self._thread.join()
        if exc_type is None:  # the stage went on: no call of its hangs (a failure keeps the record)
            self.path.unlink(missing_ok=True)

    def _watch(self) -> None:
        main = threading.main_thread().ident
        while not self._stop.wait(min(2.0, self.after_s / 4)):
            call = self.profiler.oldest_open_call()
            if call is not None and time.time() - call["t_start"] > self.after_s:
                frame = sys._current_frames().get(main)
                stack = "".join(traceback.format_stack(frame)) if frame else "(main thread gone)"
                record = {**call, "waited_s": round(time.time() - call["t_start"], 1), "stack": stack}
                # default=str: a CUDA call's times are events until the profiler resolves them
                atomic_write_text(self.path, json.dumps(record, indent=1, default=str) + "\n")
            elif self.path.exists():
                self.path.unlink()


def start_outside_watch(log_dir: Path, rank: int) -> subprocess.Popen:
    """This rank's watcher from outside (module doc), let to read this process."""
    repo = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
    watcher = subprocess.Popen(
        [sys.executable, "-m", "runtime.hang_watch", str(log_dir), str(rank), str(os.getpid())],
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": path},
    )
    let_trace(watcher.pid)
    return watcher


def watch_peers(log_dir: Path, rank: int, pid: int, every_s: float = 1.0) -> None:
    """While process `pid` (rank `rank`) is this process's parent: its stack, taken from outside,
    for each new call another rank reports waiting in while this one reports none."""
    seen: set[tuple] = set()
    while os.getppid() == pid:
        time.sleep(every_s)
        if waiting_path(log_dir, rank).exists():
            continue
        calls = {(r, w["op"], w["seq"]) for r, w in read_waiting(log_dir).items()}
        if not calls <= seen:
            seen |= calls
            atomic_write_text(stack_path(log_dir, rank), outside_stack(pid))


def read_waiting(log_dir: Path) -> dict[int, dict]:
    """The ranks' waiting records, by rank."""
    waiting = {}
    for path in log_dir.glob("rank-*.waiting.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):  # removed as its call ended
            continue
        waiting[record["rank"]] = record
    return waiting


def outside_stack(pid: int) -> str:
    """py-spy's dump of every thread of `pid`, which may be stopped: it reads the process's memory
    and never runs code in it."""
    py_spy = Path(sys.executable).with_name("py-spy")
    if not py_spy.exists():
        return f"no stack: py-spy is not installed beside {sys.executable}\n"
    out = subprocess.run(
        [str(py_spy), "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True, timeout=60
    )
    return out.stdout if out.returncode == 0 else f"no stack: py-spy failed: {out.stderr.strip()[-500:]}\n"


def hang_error(log_dir: Path) -> dict | None:
    """The collective the ranks waited in longest, who reached it, who did not and their stacks;
    None where no rank reported waiting."""
    waiting = read_waiting(log_dir)
    if not waiting:
        return None
    call = min(waiting.values(), key=lambda r: r["t_start"])
    key = (call["op"], call["seq"], tuple(call["group_ranks"]))
    reached = sorted(r for r, w in waiting.items() if (w["op"], w["seq"], tuple(w["group_ranks"])) == key)
    missing = [r for r in call["group_ranks"] if r not in reached]
    return {
        "op": call["op"],
        "seq": call["seq"],
        "phase": call["phase"],
        "step": call["step"],
        "group_ranks": call["group_ranks"],
        "waited_s": max(waiting[r]["waited_s"] for r in reached),
        "reached": reached,
        "missing": missing,
        "elsewhere": {str(r): f"waiting in {_call_words(waiting[r])}" for r in missing if r in waiting},
        "stacks": {str(r): _stack_of(log_dir, r, waiting) for r in [*reached, *missing]},
    }


def hang_summary(hang: dict) -> str:
    """One line: the call, who waited in it and who never came, where the first of those was."""
    call, waited, missing = _call_words(hang), f"{hang['waited_s']:.0f} s", hang["missing"]
    if not missing:  # every rank came: a peer cut off behind its link, or the transport stuck
        return (
            f"{call} did not end: every rank of its group ({_ranks(hang['reached'])}) waited {waited} in it"
        )
    first = str(missing[0])
    where = hang["elsewhere"].get(first) or f"at {innermost_frame(hang['stacks'][first])}"
    return (
        f"{call} did not end: rank(s) {_ranks(hang['reached'])} waited {waited} in it, "
        f"rank(s) {_ranks(missing)} never reached it; rank {first} was {where}"
    )


def innermost_frame(stack: str) -> str:
    """The innermost Python frame of the main thread in py-spy's dump ('Thread N (idle):
    "MainThread"', then frames innermost first) or a traceback (innermost last)."""
    lines = stack.splitlines()
    if lines and lines[0].startswith("Process "):
        main = next((i for i, line in enumerate(lines) if '"MainThread"' in line), None)
        return lines[main + 1].strip() if main is not None and main + 1 < len(lines) else stack.strip()[:200]
    frames = [line.strip() for line in lines if line.strip().startswith("File ")]
    return frames[-1] if frames else stack.strip()[:200]


def _stack_of(log_dir: Path, rank: int, waiting: dict) -> str:
    if rank in waiting:
        return waiting[rank]["stack"]
    path = stack_path(log_dir, rank)
    return path.read_text() if path.is_file() else "no stack: nothing watched this rank from outside"


def _call_words(call: dict) -> str:
    return f"{call['op']} #{call['seq']} (phase {call['phase']}, step {call['step']})"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


if __name__ == "__main__":
    die_with_parent()
    log_dir, rank, pid = sys.argv[1:4]
    watch_peers(Path(log_dir), int(rank), int(pid))
