"""NCCL Inspector's per-call dumps -> communication events of the docs/design.md schema (source
"nccl-inspector"), and the report's table of NCCL's own kernel timings beside ours.

Why: Inspector's time is the GPU kernel's (globaltimer, the longest of the call's channels), which our
profiler (host side, up to a CUDA event after the call) can only bound.

NCCL Inspector is NVIDIA/nccl's profiler plugin. The format read here is that of its JSON writer,
plugins/profiler/inspector/inspector_json.cc and json.cc (field meanings: inspector.cc,
inspector_plugin.cc; README.md there) at NVIDIA/nccl commit 5067397c2676d5aed50042fc39e5c8ee96eb0027
(June 2026, format "v4.0"; NCCL 2.28.3's ext-profiler/inspector wrote the same minus header.comm_name,
p2p_perf and the timing source). Each process writes `<NCCL_INSPECTOR_DUMP_DIR>/<host>-pid<pid>.log`,
one compact JSON object a line and a call:

  {"header":{"id":"0x..","comm_name":"..","rank":R,"n_ranks":N,"nnodes":K},
   "metadata":{"inspector_output_format_version":"v4.0","git_rev":"..","rec_mechanism":"..",
               "dump_timestamp_us":T,"hostname":"..","pid":P},
   "coll_perf":{"coll":"AllReduce","coll_sn":S,"coll_msg_size_bytes":B,"coll_exec_time_us":E,
                "coll_timing_source":"kernel_gpu","coll_algobw_gbs":A,"coll_busbw_gbs":W}}

or "p2p_perf" with the same fields named p2p_* and a "p2p_peer". With NCCL_INSPECTOR_DUMP_VERBOSE=1
the perf object also holds "event_trace_sn" and "event_trace_ts": gettimeofday microseconds of the
call's start and stop and of each channel's kernel start, stop and record. Prometheus mode
(NCCL_INSPECTOR_PROM_DUMP=1) writes per-communicator gauges, not calls: not read, named as unknown.

What a record does not say stays unknown (None) in the events: the training step, the dtype, the
communicator's global ranks, whether the caller waited, the stage attempt. `rank` and `group_size`
are the NCCL communicator's; `seq` is its per-(communicator, operation) counter, as ours.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from analysis.bandwidth import bus_bandwidth
from analysis.tables import Table, elapsed, rate, size
from core.rundir import RunDir

TITLE = "NCCL Inspector (kernel timings)"
SOURCE = "nccl-inspector"

# Inspector's operation names (its ncclFuncToString) -> ours. It writes "Invalid" for NCCL functions
# it has no name for (NCCL's own "AlltoAll", "Gather", "Scatter"): those are counted, not guessed.
OPS = {
    "AllReduce": "all_reduce",
    "AllGather": "all_gather",
    "AllGatherV": "all_gather",
    "ReduceScatter": "reduce_scatter",
    "Broadcast": "broadcast",
    "Reduce": "reduce",
    "All2All": "all_to_all",
    "Send": "send",
    "Recv": "recv",
    "SendRecv": "send_recv",
}
# Inspector's message size is the NCCL call's count times the element size. For these the count is
# one rank's piece (AllGather's sendcount, ReduceScatter's recvcount, AlltoAll's count per peer); our
# S is the whole array, n_ranks pieces. Inspector's own bandwidth multiplies AllGather's and
# ReduceScatter's size by n_ranks too (inspectorComputeOpBw); for the others the size is S already.
PER_RANK_PIECE = {"AllGather", "AllGatherV", "ReduceScatter", "All2All"}
# Timing sources other than the kernel's GPU clock: host timestamps, which include launch and queueing
# (kept only with NCCL_INSPECTOR_REQUIRE_KERNEL_TIMING=0).
HOST_TIMING = {"kernel_cpu", "collective_cpu"}


@dataclass
class InspectorDump:
    """What a stage's Inspector folder held: the calls as events, and what was left out and why."""

    events: list[dict] = field(default_factory=list)
    bad_lines: Counter[str] = field(default_factory=Counter)  # file -> malformed or truncated lines
    unknown_files: list[str] = field(default_factory=list)  # files with no Inspector record at all
    unknown_ops: Counter[str] = field(default_factory=Counter)  # Inspector's name -> calls left out
    host_timed: int = 0  # events whose time is the host's, not the kernel's


def whole(value, least: int = 0) -> int:
    """A JSON integer (not a bool) of at least `least`, else ValueError: the line is malformed."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"not an integer >= {least}: {value!r}")
    return value


def read_stage(stage_dir: Path) -> InspectorDump:
    """Every file under the stage's nccl-inspector/ folder (subfolders too: a dump directory per job
    id); an empty dump when there is none."""
    stage_dir = Path(stage_dir)
    folder = RunDir(stage_dir.parent).nccl_inspector(stage_dir.name)
    dump = InspectorDump()
    if folder.is_dir():
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            read_file(path, str(path.relative_to(folder)), stage_dir.name, dump)
    return dump


def read_file(path: Path, name: str, stage: str, dump: InspectorDump) -> None:
    """One process's dump, streamed: a long run's file can hold millions of lines."""
    lines = records = bad = 0
    with open(path, errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            lines += 1
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError):  # RecursionError: nesting deeper than any record's
                bad += 1
                continue
            if not (isinstance(obj, dict) and "header" in obj):
                bad += 1
                continue
            records += 1
            bad += not add_record(obj, stage, dump)
    if lines and not records:
        dump.unknown_files.append(name)
    elif bad:
        dump.bad_lines[name] += bad


def add_record(record: dict, stage: str, dump: InspectorDump) -> bool:
    """Adds the record's event (or counts its unnamed operation); False when it is malformed."""
    kind = "coll" if "coll_perf" in record else "p2p"
    try:
        perf = record[f"{kind}_perf"]
        if perf[kind] not in OPS:
            dump.unknown_ops[str(perf[kind])] += 1
            return True
        event = to_event(record["header"], record["metadata"], perf, kind, stage)
        host_timed = perf.get(f"{kind}_timing_source") in HOST_TIMING
    except (KeyError, TypeError, ValueError):
        return False
    dump.events.append(event)
    dump.host_timed += host_timed
    return True


def to_event(header: dict, meta: dict, perf: dict, kind: str, stage: str) -> dict:
    n = whole(header["n_ranks"], least=1)
    rank = whole(header["rank"])
    if rank >= n:
        raise ValueError(f"rank {rank} of {n}")
    name = perf[kind]
    size_bytes = whole(perf[f"{kind}_msg_size_bytes"])
    exec_us = whole(perf[f"{kind}_exec_time_us"])
    start_us, end_us = window(perf, kind, exec_us, whole(meta["dump_timestamp_us"]))
    return {
        "stage": stage,
        "step": None,
        "phase": "none",
        "rank": rank,
        "op": OPS[name],
        "bytes": size_bytes * n if name in PER_RANK_PIECE else size_bytes,
        "dtype": None,
        "group_size": n,
        "group_ranks": None,
        "peer": whole(perf["p2p_peer"]) if kind == "p2p" else None,
        "seq": whole(perf[f"{kind}_sn"]),
        "t_start": start_us / 1e6,
        "t_end": end_us / 1e6,
        "backend": "nccl",
        "source": SOURCE,
        "async_op": None,
        "t_wait": None,
        "attempt": None,
        "t_ready": None,
        "side_stream": None,
    }


def window(perf: dict, kind: str, exec_us: int, dumped_us: int) -> tuple[int, int]:
    """Start and end in microseconds, lasting the kernel time. Verbose dumps say when the first channel's
    kernel started (as the host saw it), else when the call started; otherwise all that is known is
    that the call had ended when it was dumped, so it is placed to end then."""
    trace = perf.get("event_trace_ts")
    if isinstance(trace, dict):
        starts = [whole(k["kernel_start_ts"]) for k in trace.get("kernel_events", [])]
        start = min((s for s in starts if s > 0), default=whole(trace[f"{kind}_start_ts"]))
        if start > 0:
            return start, start + exec_us
    return dumped_us - exec_us, dumped_us


def kernel_seconds(event: dict) -> float:
    """The event's duration. Inspector's times are whole microseconds; epoch seconds as floats keep
    only ~0.2 us, so rounding back to the microsecond gives Inspector's exact time."""
    return round((event["t_end"] - event["t_start"]) * 1e6) / 1e6


def size_bucket(nbytes: int) -> int:
    """The power of two at or below nbytes (0 for 0)."""
    return 1 << (nbytes.bit_length() - 1) if nbytes > 0 else 0


def bucket_label(low: int) -> str:
    return f"[{size(low)}, {size(2 * low)})" if low else "0 B"


def summary_table(events: list[dict]) -> Table:
    """Per operation, communicator size and power-of-two size of S: calls over every rank, median
    kernel time and median bus bandwidth (analysis/bandwidth.py on S, as the other tables)."""
    groups = defaultdict(list)
    for e in events:
        groups[e["op"], e["group_size"], size_bucket(e["bytes"])].append(e)
    rows = []
    for (op, n, low), mine in sorted(groups.items()):
        seconds = [kernel_seconds(e) for e in mine]
        busbw = [bus_bandwidth(op, e["bytes"], t, n) for e, t in zip(mine, seconds)]
        rows.append(
            [
                op,
                str(n),
                bucket_label(low),
                str(len(mine)),
                elapsed(statistics.median(seconds)),
                rate(statistics.median(busbw)),
            ]
        )
    header = ["op", "ranks", "size", "calls (all ranks)", "median kernel time", "median busbw"]
    return Table(TITLE, header, rows)


def notes(dump: InspectorDump) -> list[str]:
    """One sentence for each kind of thing the table left out."""
    out = []
    if dump.bad_lines:
        listed = ", ".join(f"{name} ({n})" for name, n in sorted(dump.bad_lines.items()))
        total = dump.bad_lines.total()
        out.append(f"NCCL Inspector: skipped {total} malformed or truncated lines: {listed}.")
    if dump.unknown_files:
        out.append(
            "NCCL Inspector: not read, no Inspector JSON record in them (Prometheus mode is not read): "
            + ", ".join(dump.unknown_files)
            + "."
        )
    if dump.unknown_ops:
        listed = ", ".join(f"{name} ({n})" for name, n in sorted(dump.unknown_ops.items()))
        out.append(
            f"NCCL Inspector: left out calls of operations we do not map: {listed} (Invalid is what "
            "Inspector writes for NCCL functions it does not know, such as AlltoAll, Gather, Scatter)."
        )
    if dump.host_timed:
        out.append(
            f"NCCL Inspector: {dump.host_timed} of the calls were timed on the host, not the GPU kernel "
            "(timing source kernel_cpu or collective_cpu): their times include launch and queueing."
        )
    return out


class Document(Protocol):
    """What the section needs of analysis.report's Document."""

    def paragraph(self, text: str) -> None: ...

    def table(self, table: Table) -> None: ...


def add_section(doc: Document, stage_dir: Path) -> None:
    """The stage's Inspector table and what was left out of it; nothing when it has no dump."""
    dump = read_stage(stage_dir)
    if dump.events:
        doc.paragraph(
            "NCCL's own time per call, from NCCL Inspector's dumps in nccl-inspector/ (the longest "
            "channel's kernel time on the GPU), over every rank and communicator; not in the tables "
            "above. Inspector leaves out messages under NCCL_INSPECTOR_DUMP_MIN_SIZE_BYTES (8 KiB)."
        )
        doc.table(summary_table(dump.events))
    for note in notes(dump):
        doc.paragraph(note)
