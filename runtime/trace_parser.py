"""torch.profiler chrome traces -> communication events of the docs/design.md schema (source "trace"),
so traces made elsewhere (verl's torch profiler, say) feed the same report.

NCCL traces: one `record_param_comms` cpu_op per call carries the collective's name, message sizes,
dtype, group size and ranks; its GPU time is the `nccl*` kernel (or `nccl:` GPU annotation) launched
under it (same "External id" as the call or its `nccl:` annotation). Gloo traces have no
record_param_comms: the `c10d::<op>` cpu_op gives the op and the tensors' dims, and the `gloo:<op>`
annotation that the gloo thread runs next gives the dtype and the completion (its duration includes
waiting for peers). Gloo traces name no group: the world group (distributedInfo) is assumed.
Phases come from the enclosing `phase:<name>` ranges (runtime/phases.py), or from ranges another
trainer names (`phase_names`: verl's role annotations), steps from ProfilerStep#N. Traces may be
gzipped (verl writes .json.gz).
"""

from __future__ import annotations

import gzip
import json
from bisect import bisect_right
from pathlib import Path

from runtime.comm_profiler import C10D_OPS, PER_RANK_PIECE

NCCL_NAMES = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "_allgather_base": "all_gather",
    "allgather": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast": "broadcast",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all",
    "send": "send",
    "recv": "recv",
    "barrier": "barrier",
    "gather": "gather",
    "scatter": "scatter",
    "reduce": "reduce",
}
# element sizes by the names the profiler uses: ScalarType names (NCCL "dtype") and C++ names (Input type)
ELEMENT = {
    "Float": ("float32", 4),
    "float": ("float32", 4),
    "Double": ("float64", 8),
    "double": ("float64", 8),
    "Half": ("float16", 2),
    "c10::Half": ("float16", 2),
    "BFloat16": ("bfloat16", 2),
    "c10::BFloat16": ("bfloat16", 2),
    "Long": ("int64", 8),
    "long int": ("int64", 8),
    "Int": ("int32", 4),
    "int": ("int32", 4),
    "Byte": ("uint8", 1),
    "unsigned char": ("uint8", 1),
    "Char": ("int8", 1),
    "signed char": ("int8", 1),
    "Bool": ("bool", 1),
    "bool": ("bool", 1),
}


def parse_trace(path: Path, stage: str = "trace", phase_names: dict[str, str] | None = None) -> list[dict]:
    """`phase_names`: {range name: phase} for ranges that are phases without our `phase:` prefix."""
    path = Path(path)
    with gzip.open(path, "rt") if path.suffix == ".gz" else open(path) as f:
        trace = json.load(f)
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    info = trace.get("distributedInfo", {})
    context = Context(
        spans, trace.get("baseTimeNanoseconds", 0), stage, info.get("rank", 0), phase_names or {}
    )
    if any(e["name"] == "record_param_comms" for e in spans):
        return nccl_events(spans, context)
    return gloo_events(spans, context, tuple(range(info.get("world_size", 1))), info.get("backend", "gloo"))


class Context:
    """What an event inherits from where it sits in the trace: phase, step, wall-clock time."""

    def __init__(self, spans: list[dict], base_ns: int, stage: str, rank: int, phase_names: dict[str, str]):
        self.base_ns, self.stage, self.rank = base_ns, stage, rank
        self.phase_names = {
            **phase_names,
            **{e["name"]: e["name"].removeprefix("phase:") for e in spans if e["name"].startswith("phase:")},
        }
        self.phases = sorted((e for e in spans if e["name"] in self.phase_names), key=lambda e: e["ts"])
        self.steps = sorted(
            (e for e in spans if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"]
        )

    def seconds(self, ts_us: float) -> float:
        return (ts_us * 1e3 + self.base_ns) / 1e9

    def enclosing(self, ranges: list[dict], ts: float) -> dict | None:
        inside = [
            r for r in ranges[: bisect_right([r["ts"] for r in ranges], ts)] if r["ts"] + r["dur"] >= ts
        ]
        return max(inside, key=lambda r: r["ts"]) if inside else None  # innermost = latest start

    def event(
        self,
        op: str,
        nbytes: int,
        dtype: str | None,
        ranks: tuple[int, ...],
        start_us: float,
        end_us: float,
        backend: str,
        seq: dict,
    ) -> dict:
        phase = self.enclosing(self.phases, start_us)
        step = self.enclosing(self.steps, start_us)
        key = (ranks, op)
        seq[key] = seq.get(key, -1) + 1
        return {
            "stage": self.stage,
            "step": int(step["name"].split("#")[1]) if step else 0,
            "phase": self.phase_names[phase["name"]] if phase else "none",
            "rank": self.rank,
            "op": op,
            "bytes": nbytes,
            "dtype": dtype,
            "group_size": len(ranks),
            "group_ranks": list(ranks),
            "peer": None,
            "seq": seq[key],
            "t_start": self.seconds(start_us),
            "t_end": self.seconds(end_us),
            "backend": backend,
            "source": "trace",
            "async_op": False,
        }


def nccl_events(spans: list[dict], ctx: Context) -> list[dict]:
    gpu = {
        e["args"]["External id"]: e
        for e in spans
        if e.get("cat") in ("kernel", "gpu_user_annotation")
        and e["name"].lower().startswith("nccl")
        and "External id" in e.get("args", {})
    }
    annotations = sorted(
        (e for e in spans if e.get("cat") == "user_annotation" and e["name"].startswith("nccl:")),
        key=lambda e: e["ts"],
    )
    events, seq = [], {}
    for call in sorted((e for e in spans if e["name"] == "record_param_comms"), key=lambda e: e["ts"]):
        args = call["args"]
        op = NCCL_NAMES.get(args.get("Collective name", ""))
        if op is None:  # "wait", "coalesced" markers and the like move no data
            continue
        dtype, size = ELEMENT.get(args.get("dtype", ""), (None, 0))
        nelems = args.get("Out msg nelems" if op in ("all_gather", "gather") else "In msg nelems", 0)
        ranks = tuple(json.loads(args.get("Process Group Ranks", "[]"))) or (ctx.rank,)
        inner = [a for a in annotations if call["ts"] <= a["ts"] <= call["ts"] + call["dur"]]
        ids = [args.get("External id")] + [a["args"].get("External id") for a in inner]
        timed = next((gpu[i] for i in ids if i in gpu), call)
        events.append(
            ctx.event(op, nelems * size, dtype, ranks, timed["ts"], timed["ts"] + timed["dur"], "nccl", seq)
        )
    return events


def gloo_events(spans: list[dict], ctx: Context, ranks: tuple[int, ...], backend: str) -> list[dict]:
    calls = outermost(
        sorted(
            (
                e
                for e in spans
                if e.get("cat") == "cpu_op"
                and e["name"].startswith("c10d::")
                and e["name"].removeprefix("c10d::") in C10D_OPS
            ),
            key=lambda e: e["ts"],
        )
    )
    transfers = sorted((e for e in spans if e["name"].startswith("gloo:")), key=lambda e: e["ts"])
    events, seq = [], {}
    for call in calls:
        op, size_arg, _, _ = C10D_OPS[call["name"].removeprefix("c10d::")]
        transfer = next((t for t in transfers if t["ts"] >= call["ts"]), None)
        if transfer is not None:
            transfers.remove(transfer)
        dtype, size = ELEMENT.get((transfer or {}).get("args", {}).get("Input type", [""])[0], (None, 0))
        dims = call["args"].get("Input Dims", [])
        numel = count_elements(dims[size_arg]) if size_arg is not None and size_arg < len(dims) else 0
        nbytes = numel * size * (len(ranks) if op in PER_RANK_PIECE else 1)
        end = max(call["ts"] + call["dur"], transfer["ts"] + transfer["dur"] if transfer else 0)
        events.append(ctx.event(op, nbytes, dtype, ranks, call["ts"], end, backend, seq))
    return events


def outermost(calls: list[dict]) -> list[dict]:
    """Drop a c10d op nested in another of the same name (a Python kernel re-dispatching, as the
    comm profiler's does, shows the op twice)."""
    kept: list[dict] = []
    for call in calls:
        parent = kept[-1] if kept else None
        if (
            parent
            and parent["name"] == call["name"]
            and parent.get("tid") == call.get("tid")
            and call["ts"] + call["dur"] <= parent["ts"] + parent["dur"]
        ):
            continue
        kept.append(call)
    return kept


def count_elements(dims) -> int:
    """Input Dims of one argument: [d0, d1, ...] for a tensor, [[...], [...]] for a tensor list."""
    if not dims:
        return 0
    if isinstance(dims[0], list):
        return sum(count_elements(d) for d in dims)
    total = 1
    for d in dims:
        total *= d
    return total
