"""When one rank of a stage fails: what each rank leaves behind, and which rank failed first.

A rank that raises records its exception in logs/rank-NNNNN.error.json (launch.worker). A rank
that crashes (a segfault in native code) leaves the Python stack of the crash in
logs/rank-NNNNN.fatal.txt, written by faulthandler. A rank killed by a signal cannot write anything,
so the launcher writes how torchrun saw every failed rank end (exit code or signal, in the order it
saw them) to logs/torchrun-failures.json (launch.torchrun; ranks started by srun have only their own
records), and a rank forked by torchrun's forkserver has the process that forked it write how it
ended to logs/rank-NNNNN.exit.json (torchrun reports only the first of those to end). The driver
reads them all back into one structured error for the manifest.

The surviving ranks are not left blocked in a collective: the failed rank's process ends at once
(launch.worker skips the interpreter's slow orderly exit), gloo raises on the others as soon as its
sockets close, and torchrun sends SIGTERM to every rank still running, then SIGKILL 30 s later
(torch.distributed.elastic.multiprocessing.api, PContext.close). No handler of ours
delays the SIGTERM: runtime.preemption takes only USR1.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import signal
import time
import traceback
from pathlib import Path

from core.atomic import atomic_write_text
from runtime.hang_watch import hang_error, hang_summary

# Test seam: "rank=1,step=3" makes rank 1 raise InjectedFailure as step 3 begins (StageContext.begin_step).
FAIL_AT_ENV = "HPCR1_FAIL_AT"
TORCHRUN_FAILURES = "torchrun-failures.json"
# {node: Slurm state} of the stage job's nodes found down or not responding when its srun step failed
# (launch.slurm_launch): a rank on a vanished node records nothing of its own.
LOST_NODES = "lost-nodes.json"


class InjectedFailure(RuntimeError):
    pass


def fail_if_asked(rank: int, step: int) -> None:
    spec = os.environ.get(FAIL_AT_ENV)
    if not spec:
        return
    target = dict(part.split("=") for part in spec.split(","))
    if (int(target["rank"]), int(target["step"])) == (rank, step):
        raise InjectedFailure(f"{FAIL_AT_ENV}={spec}: rank {rank} fails as step {step} begins")


def record_path(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank-{rank:05d}.error.json"


def fatal_path(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank-{rank:05d}.fatal.txt"


def exit_path(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank-{rank:05d}.exit.json"


def record_exit(log_dir: Path, rank: int, exitcode: int) -> None:
    """How a rank process ended (a negative code: the signal), as torchrun would report it, with
    the time it was seen to end; written by its parent."""
    entry = {
        "rank": rank,
        "exitcode": exitcode,
        "signal": signal.Signals(-exitcode).name if exitcode < 0 else None,
        "timestamp": time.time(),
    }
    atomic_write_text(exit_path(log_dir, rank), json.dumps(entry, indent=2) + "\n")


def record_crashes(log_dir: Path, rank: int) -> None:
    """From now on a crash of this process (SIGSEGV, SIGBUS, SIGFPE, SIGABRT, SIGILL) writes the
    Python stack of every thread to fatal_path: the file is opened for the life of the process."""
    faulthandler.enable(file=open(fatal_path(log_dir, rank), "w"), all_threads=True)


def record_exception(log_dir: Path, rank: int, exc: BaseException) -> None:
    """`exc` as the manifest's failure of `rank`: its type, message and traceback (none where it was
    never raised)."""
    record = {
        "rank": rank,
        "time": time.time(),
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc))[-4000:],
    }
    atomic_write_text(record_path(log_dir, rank), json.dumps(record, indent=2) + "\n")


def forget_failures(log_dir: Path) -> None:
    """Before an attempt: what an earlier attempt's ranks left must not be read as this one's."""
    for path in [
        *log_dir.glob("rank-*.error.json"),
        *log_dir.glob("rank-*.fatal.txt"),
        *log_dir.glob("rank-*.exit.json"),
        *log_dir.glob("rank-*.waiting.json"),
        *log_dir.glob("rank-*.stack.txt"),
        *log_dir.glob(f"*{TORCHRUN_FAILURES}"),
        *log_dir.glob(LOST_NODES),
    ]:
        path.unlink()


# The last exception a Python process printed: "pkg.ModError: msg", or Ray's
# "ray.exceptions.RayTaskError(ValueError): msg".
_EXCEPTION_LINE = re.compile(
    r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit))(?:\((?P<cause>\w+)\))?: (?P<message>.*)$"
)


def record_printed_exception(log_dir: Path, rank: int, output: str) -> bool:
    """Record the last exception a child process (verl's trainer) printed to `output` as rank
    `rank`'s failure, with the indented lines after it (Ray puts the dead actor's class there).
    False where it printed none."""
    lines = output.splitlines()
    found = [i for i, line in enumerate(lines) if _EXCEPTION_LINE.match(line)]
    if not found:
        return False
    match = _EXCEPTION_LINE.match(lines[found[-1]])
    detail = [line.strip() for line in lines[found[-1] + 1 : found[-1] + 6] if line[:1].isspace()]
    record = {
        "rank": rank,
        "time": time.time(),
        "type": match["cause"] or match["type"].rsplit(".", 1)[-1],
        "message": " ".join([match["message"], *detail]).strip(),
        "traceback": "\n".join(lines[max(0, found[-1] - 40) : found[-1] + 6])[-4000:],
    }
    atomic_write_text(record_path(log_dir, rank), json.dumps(record, indent=2) + "\n")
    return True


def read_failures(log_dir: Path) -> tuple[dict[int, dict], dict[int, dict]]:
    """(how torchrun saw the failed ranks end, by rank in the order it saw them; the exceptions the
    ranks recorded, by rank). Under Slurm each node's torchrun writes a file of its own, named
    after the node."""
    exits = [
        e for path in sorted(log_dir.glob(f"*{TORCHRUN_FAILURES}")) for e in json.loads(path.read_text())
    ]
    # A forked rank's parent saw every end, to the millisecond: those win over torchrun's first one.
    forked = [json.loads(p.read_text()) for p in log_dir.glob("rank-*.exit.json")]
    forked.sort(key=lambda e: e["timestamp"])
    exits = [*(e for e in exits if e["rank"] not in {f["rank"] for f in forked}), *forked]
    records = [json.loads(p.read_text()) for p in log_dir.glob("rank-*.error.json")]
    crashes = [_crash_record(p) for p in log_dir.glob("rank-*.fatal.txt") if p.stat().st_size]
    return {e["rank"]: e for e in exits}, {r["rank"]: r for r in [*crashes, *records]}


_FATAL = "Fatal Python error:"


def _crash_record(path: Path) -> dict:
    """faulthandler's dump ("Fatal Python error: Segmentation fault", then each thread's stack, most
    recent call first) as a record: the crash, and the innermost Python line it happened under."""
    lines = path.read_text().splitlines()
    # A dump cut short (the process killed while writing it) may lack the first line.
    crash = next((line for line in lines if line.startswith(_FATAL)), f"{_FATAL} unknown crash")
    where = next((line.strip() for line in lines if line.strip().startswith("File ")), "no Python frame")
    return {
        "rank": int(path.name[len("rank-") :].split(".")[0]),
        "time": path.stat().st_mtime,
        "type": "Fatal Python error",
        "message": f"{crash[len(_FATAL) :].strip()} in {where}",
        "traceback": "\n".join(lines)[-4000:],
    }


def first_failed_rank(exits: dict[int, dict], records: dict[int, dict]) -> int | None:
    """The rank whose failure came first. A rank that raised is timed by its record; a rank killed
    by a signal by torchrun's timestamp, whole seconds taken within its 0.1 s poll of the death, so
    one second earlier is before the death (and before the 'Connection closed by peer' it causes on
    a survivor). Ranks stopped by torchrun's own SIGTERM, without a record, come after the cause."""

    def when(rank: int) -> float:
        return records[rank]["time"] if rank in records else exits[rank]["timestamp"] - 1

    causes = set(records) | {r for r, e in exits.items() if e["signal"] not in (None, "SIGTERM")}
    # Equal times: the order in which torchrun saw the ranks end.
    order = [*exits, *sorted(set(records) - set(exits))]
    return min(causes or exits, key=lambda r: (when(r), order.index(r)), default=None)


def how_it_ended(rank: int, exits: dict[int, dict], records: dict[int, dict]) -> str:
    if rank in records:
        return f"{records[rank]['type']}: {records[rank]['message']}"
    signal, code = exits[rank]["signal"], exits[rank]["exitcode"]
    return f"killed by {signal}" if signal else f"exited with code {code}"


def stage_error(log_dir: Path, exit_code: int) -> dict:
    """The manifest's `error` for a stage whose ranks failed: the first failed rank, how (exception
    or signal), its log, and how every other failed rank ended."""
    error = _rank_error(log_dir, exit_code)
    hang = hang_error(log_dir)
    if hang is not None:
        error["hang"] = hang
    if hang is not None and error["rank"] in [None, *hang["reached"]]:
        # The first rank failed of the call's timeout: the call and the ranks absent from it are the news.
        error["summary"] = f"{hang_summary(hang)} (log: {error.get('log') or log_dir})"
    lost_path = log_dir / LOST_NODES
    if lost_path.is_file():
        lost = json.loads(lost_path.read_text())
        error.update(summary=f"{lost_nodes_summary(lost)}; {error['summary']}", lost_nodes=lost)
    return error


def lost_nodes_summary(lost: dict[str, str]) -> str:
    """`hpcr1 status`'s words for {node: Slurm's state}: "node(s) lost: mnode2 (down*)"."""
    return "node(s) lost: " + ", ".join(f"{node} ({state})" for node, state in lost.items())


def _rank_error(log_dir: Path, exit_code: int) -> dict:
    exits, records = read_failures(log_dir)
    rank = first_failed_rank(exits, records)
    if rank is None:
        return {
            "summary": f"ranks exited with code {exit_code}; no rank recorded why (logs in {log_dir})",
            "exit_code": exit_code,
            "rank": None,
        }
    record = records.get(rank, {})
    log = str(log_dir / f"rank-{rank:05d}.log")
    how = how_it_ended(rank, exits, records)
    others = sorted((set(exits) | set(records)) - {rank})
    return {
        "summary": f"rank {rank} failed first: {how} (log: {log})",
        "exit_code": exit_code,
        "rank": rank,
        "how": how,
        "signal": None if record else exits[rank]["signal"],
        "exception": record.get("type"),
        "message": record.get("message"),
        "traceback": record.get("traceback"),
        "log": log,
        "others": {str(r): how_it_ended(r, exits, records) for r in others},
    }
