"""Records every torch.distributed collective and point-to-point call as one event (docs/design.md,
"Communication events"), whoever makes it: our code, megatron-core, DeepSpeed, DDP's C++ reducer,
FSDP2 and functional collectives.

Why the dispatcher and not patched `torch.distributed` functions: every c10d call ends in a
dispatcher op (`c10d::allreduce_`, ...; even DDP's reducer and ProcessGroup's C++ methods go through
them), whereas patched functions miss callers that imported the function object before the patch
and everything issued from C++. A TorchDispatchMode would also see them, but it runs Python on every
aten op of the step. So `start()` registers a Python kernel for the c10d ops alone, at the
BackendSelect dispatch key: every dispatch passes it whatever the device, with autograd on, off or
in inference mode (which skips the Autograd keys), and no c10d op has a kernel of its own there. The
kernel notes the call and redispatches straight to the backend kernel. Only the communication calls
pay.

Functional collectives (`_c10d_functional::*`, used by DTensor and compiled code) are recorded at
their own level (completion observed at `wait_tensor`); the c10d calls they make inside are not
recorded again.

Completion: the backend's Work future; its callback stamps `t_end` (gloo runs it when the transfer
is done). Gloo's send/recv/reduce_scatter Works have no future: they are stamped when a Python
`Work.wait()` on that very Work returns (torch.distributed's synchronous calls wait at once); a
Work nobody waits on leaves its call's t_end null. NCCL's coalesced calls (`batch_isend_irecv`, a
`_coalescing_manager` block) complete with the Work that ends the block.

On CUDA three moments are kept apart: `t_start`, when the host enqueued the call; `t_ready`, when
the stream that issued it reached it (a CUDA event recorded just before: the collective's own
stream waits for that point, so the difference is the GPU work queued ahead of the call); and
`t_end`, a CUDA event recorded where the issuing stream has been made to wait for the collective
(the future's callback, or after `wait_tensor`). Across ranks, the spread of `t_ready` is waiting
for the peers and what follows the last one is the transfer (analysis/matching.py). CUDA events are
turned into wall-clock times when written, against a clock re-anchored every second
(runtime/device_clock.py) so that they stay exact to the microsecond however long the stage.

Times are wall-clock seconds (time.time()) so that ranks on one node compare directly; across nodes
they are as good as the nodes' clock synchronisation.

Events reach the rank's file as the stage goes: a thread appends the completed ones every
`flush_every_s`, so a rank killed without warning (SIGKILL, the OOM killer, a time limit) loses at
most that interval. Calls never seen to complete are kept back, up to MAX_PENDING of them.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from runtime.device_clock import DeviceClock, Mark
from runtime.phases import current_phase

# docs/design.md's schema, plus async_op: whether the caller went on working while the call ran (the only
# calls whose time can overlap compute; analysis/overlap.py), and t_wait: when the caller began waiting
# for an async call's result, where that is seen (functional collectives' wait_tensor), else null;
# from t_wait to t_end the call blocked its caller (DTensor's full_tensor() waits at once); and
# attempt: the stage's attempt (manifest) whose ranks made the call. Every attempt appends to the same
# file, so steps an attempt redoes after a crash are recorded twice; the reader keeps the last.
# t_ready: on CUDA, when the issuing stream reached the call (module doc); side_stream: on CUDA, whether
# that stream is not the device's default stream, where compute runs (DeepSpeed's overlap_comm
# reduction stream, FSDP2's all-gather stream): then compute goes on beside even a synchronous call.
# Both null elsewhere.
FIELDS = (
    "stage",
    "step",
    "phase",
    "rank",
    "op",
    "bytes",
    "dtype",
    "group_size",
    "group_ranks",
    "peer",
    "seq",
    "t_start",
    "t_end",
    "backend",
    "source",
    "async_op",
    "t_wait",
    "attempt",
    "t_ready",
    "side_stream",
)
T_START = FIELDS.index("t_start")
T_WAIT = FIELDS.index("t_wait")
T_END = FIELDS.index("t_end")
T_READY = FIELDS.index("t_ready")
SIDE_STREAM = FIELDS.index("side_stream")
TIMES = (T_END, T_READY)
# Pending calls kept back for their completion; beyond that the oldest are written with t_end null
# (gloo Works nobody waits on would otherwise grow the buffer for the whole stage).
MAX_PENDING = 10_000
BELOW_BACKEND_SELECT = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)
# Gloo Works held for a Python wait() to find (holding one keeps its tensors): beyond this many, the
# oldest are let go and their calls' t_end stays null.
MAX_UNWAITED = 1_000

_active: CommProfiler | None = None
# .source: set while a library's own comm API (deepspeed.comm) is on the stack; .in_functional: while a
# functional collective runs (its inner c10d call is not a call of its own).
_caller = threading.local()


def nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(nbytes(t) for t in x) if isinstance(x, (list, tuple)) else 0


def first_tensor(x) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    for item in x if isinstance(x, (list, tuple)) else ():
        found = first_tensor(item)
        if found is not None:
            return found
    return None


# c10d op -> (our op name, index of the argument whose size is S in nccl-tests' terms, index of the
# process group, index of the peer's group rank or None). S is the whole array: the gathered output
# of all_gather, the input of reduce_scatter and all_to_all, the tensor itself otherwise.
C10D_OPS = {
    "allreduce_": ("all_reduce", 0, 1, None),
    "allreduce_coalesced_": ("all_reduce", 0, 1, None),
    "allgather_": ("all_gather", 0, 2, None),
    "_allgather_base_": ("all_gather", 0, 2, None),
    "allgather_coalesced_": ("all_gather", 0, 2, None),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, 2, None),
    "reduce_scatter_": ("reduce_scatter", 1, 2, None),
    "_reduce_scatter_base_": ("reduce_scatter", 1, 2, None),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 2, None),
    "alltoall_": ("all_to_all", 1, 2, None),
    "alltoall_base_": ("all_to_all", 1, 2, None),
    "broadcast_": ("broadcast", 0, 1, None),
    "reduce_": ("reduce", 0, 1, None),
    "gather_": ("gather", 1, 2, None),
    "scatter_": ("scatter", 0, 2, None),
    "barrier": ("barrier", None, 1, None),
    "monitored_barrier_": ("barrier", None, 1, None),
    "send": ("send", 0, 1, 2),
    "recv_": ("recv", 0, 1, 2),
    "recv_any_source_": ("recv", 0, 1, None),
}
# gather/scatter move one rank's piece to or from every rank: S = piece * group size.
PER_RANK_PIECE = {"gather", "scatter"}

# _c10d_functional op -> (our op name, index of the group name, index of the peer or None,
# whether S is the input times the group size (all_gather) or the input itself).
FUNCTIONAL_OPS = {
    "all_reduce": ("all_reduce", 2, None, False),
    "all_reduce_": ("all_reduce", 2, None, False),
    "all_reduce_coalesced": ("all_reduce", 2, None, False),
    "all_reduce_coalesced_": ("all_reduce", 2, None, False),
    "all_gather_into_tensor": ("all_gather", 2, None, True),
    "all_gather_into_tensor_out": ("all_gather", 2, None, True),
    "all_gather_into_tensor_coalesced": ("all_gather", 2, None, True),
    "reduce_scatter_tensor": ("reduce_scatter", 3, None, False),
    "reduce_scatter_tensor_out": ("reduce_scatter", 3, None, False),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 3, None, False),
    "all_to_all_single": ("all_to_all", 3, None, False),
    "broadcast": ("broadcast", 2, None, False),
    "broadcast_": ("broadcast", 2, None, False),
    "isend": ("send", 3, 1, False),
    "irecv": ("recv", 3, 1, False),
}


class CommProfiler:
    """Per-rank recorder of communication events, written to `<out_dir>/rank-NNNNN.jsonl`.

    with CommProfiler(run.profile(stage_id), stage_id, rank) as prof:
        for step in ...:
            prof.set_step(step)
            ...
            prof.flush()   # optional: writes what has completed so far
    """

    def __init__(self, out_dir: Path, stage: str, rank: int, attempt: int = 1, flush_every_s: float = 2.0):
        self.path = Path(out_dir) / f"rank-{rank:05d}.jsonl"
        self.stage, self.rank, self.attempt, self.step = stage, rank, attempt, 0
        self.events: list[list] = []  # rows in FIELDS order, t_end filled in on completion
        self.flush_every_s = flush_every_s
        self._lock = threading.Lock()  # the flusher thread swaps `events` while ranks record
        self._stopping = threading.Event()
        self._flusher: threading.Thread | None = None
        self._seq: dict[tuple, int] = {}
        self._groups: dict[str, tuple[tuple[int, ...], str]] = {}
        self._libs: list[torch.library.Library] = []
        self._cuda_clock: DeviceClock | None = None
        self._pending_functional: dict[int, list] = {}
        self._unwaited: dict[int, tuple[object, list]] = {}  # id(Work) -> (Work, event): no future
        self._coalescing: list[list[list]] = []  # events of each open NCCL coalescing block

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> CommProfiler:
        global _active
        if _active is not None:
            raise RuntimeError("a CommProfiler is already active in this process")
        _active = self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if torch.cuda.is_available():
            self._cuda_clock = DeviceClock(torch.cuda)
        self._libs = [
            torch.library.Library("c10d", "IMPL"),
            torch.library.Library("_c10d_functional", "IMPL"),
        ]
        for name in C10D_OPS:
            self._register(self._libs[0], "c10d", name, self._c10d_kernel)
        for name in [*FUNCTIONAL_OPS, "wait_tensor"]:
            self._register(self._libs[1], "_c10d_functional", name, self._functional_kernel)
        Work.wait = _wait_and_stamp
        ProcessGroup._start_coalescing, ProcessGroup._end_coalescing = _start_coalescing, _end_coalescing
        tag_library_callers()
        self._stopping.clear()
        self._flusher = threading.Thread(target=self._flush_periodically, name="comm-flush", daemon=True)
        self._flusher.start()
        return self

    def _flush_periodically(self) -> None:
        while not self._stopping.wait(self.flush_every_s):
            self.flush()

    def _register(self, lib, namespace: str, name: str, kernel_factory) -> None:
        ops = getattr(torch.ops, namespace)
        if not hasattr(ops, name):  # an op this torch release does not have
            return
        op = getattr(ops, name).default
        kernel = kernel_factory(name, op)
        kernel.__name__ = f"hpcr1_profiled_{name}"
        lib.impl(name, kernel, "BackendSelect")

    def set_step(self, step: int) -> None:
        self.step = step
        tag_library_callers()  # DeepSpeed may have been imported after start()

    def oldest_open_call(self) -> dict | None:
        """The longest-running call not yet seen to complete, as an event dict; None when none is open."""
        with self._lock:
            open_calls = [e for e in self.events if completion_unknown(e)]
        return dict(zip(FIELDS, min(open_calls, key=lambda e: e[T_START]))) if open_calls else None

    def flush(self, everything: bool = False) -> None:
        """Append the completed events to the rank's file; pending ones wait for a later flush,
        unless `everything` (the end: never seen to complete, their t_end stays null) or there are
        more than MAX_PENDING of them."""
        with self._lock:
            self._resolve_cuda_times(block=everything)
            done, pending = [], []
            for e in self.events:
                (pending if completion_unknown(e) and not everything else done).append(e)
            overflow = max(0, len(pending) - MAX_PENDING)
            self.events = pending[overflow:]
            self._write(done + pending[:overflow])

    def _write(self, events: list[list]) -> None:
        # One write call of whole lines: a kill mid-write leaves at most one partial last line.
        text = "".join(json.dumps(dict(zip(FIELDS, e)), default=_unresolved) + "\n" for e in events)
        with open(self.path, "a") as f:
            f.write(text)

    def stop(self) -> None:
        global _active
        self._stopping.set()
        if self._flusher is not None:
            self._flusher.join()
            self._flusher = None
        for lib in self._libs:
            lib._destroy()
        self._libs = []
        _active = None
        Work.wait = _original_wait
        ProcessGroup._start_coalescing, ProcessGroup._end_coalescing = _original_coalescing
        self._unwaited.clear()  # let go of the Works (and their tensors) nobody waited on
        self.flush(everything=True)

    def __enter__(self) -> CommProfiler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- recording -------------------------------------------------------------------------
    def record(
        self,
        op: str,
        nbytes_: int,
        dtype: str,
        group_ranks: tuple[int, ...],
        peer: int | None,
        backend: str,
        source: str,
        async_op: bool = False,
    ) -> list:
        """Append one event (t_end still open) and return it; also used by the mpi4py wrapper."""
        key = (group_ranks, op)
        seq = self._seq.get(key, 0)
        self._seq[key] = seq + 1
        event = [
            self.stage,
            self.step,
            current_phase(),
            self.rank,
            op,
            nbytes_,
            dtype,
            len(group_ranks),
            list(group_ranks),
            peer,
            seq,
            time.time(),
            None,
            backend,
            source,
            async_op,
            None,
            self.attempt,
            None,
            None,
        ]
        with self._lock:
            self.events.append(event)
        if self._coalescing:
            self._coalescing[-1].append(event)
        return event

    def _group(self, pg) -> tuple[tuple[int, ...], str]:
        if isinstance(pg, torch.ScriptObject):
            pg = dist.ProcessGroup.unbox(pg)
        name = pg.group_name
        if name not in self._groups:
            self._groups[name] = (tuple(dist.get_process_group_ranks(pg)), str(dist.get_backend(pg)))
        return self._groups[name]

    def _c10d_kernel(self, name: str, op):
        label, size_arg, pg_arg, peer_arg = C10D_OPS[name]
        names = [a.name for a in op._schema.arguments]
        async_arg = names.index("async_op") if "async_op" in names else None
        # A boxed call drops trailing arguments equal to their defaults: absent means the schema's
        # default (True: ProcessGroup's own calls are async unless the caller asked otherwise).
        async_default = (
            bool(op._schema.arguments[async_arg].default_value) if async_arg is not None else False
        )

        def kernel(*args):
            tensor = first_tensor(args)
            below = torch._C._dispatch_keys(tensor) & BELOW_BACKEND_SELECT
            if getattr(_caller, "in_functional", False):
                return op.redispatch(below, *args)
            ranks, backend = self._group(args[pg_arg])
            sized = args[size_arg] if size_arg is not None else ()
            size = nbytes(sized) * (len(ranks) if label in PER_RANK_PIECE else 1)
            peer = ranks[args[peer_arg]] if peer_arg is not None else None
            is_async = (
                bool(args[async_arg]) if async_arg is not None and async_arg < len(args) else async_default
            )
            moved = first_tensor(sized) if size_arg is not None else tensor
            event = self.record(label, size, dtype_name(moved), ranks, peer, backend, source_name(), is_async)
            on_cuda = self._mark_ready(event, tensor)
            out = op.redispatch(below, *args)
            if not self._coalescing:  # inside a block, the Work that ends the block completes the call
                self._on_completion(out[1] if isinstance(out, tuple) else out, event, on_cuda)
            return out

        return kernel

    def _functional_kernel(self, name: str, op):
        if name == "wait_tensor":

            def wait(tensor):
                event = self._pending_functional.pop(tensor.data_ptr(), None)
                if event is not None:
                    event[T_WAIT] = time.time()
                out = op.redispatch(torch._C._dispatch_keys(tensor) & BELOW_BACKEND_SELECT, tensor)
                if event is not None:  # on CUDA, where the current stream has been made to wait
                    event[T_END] = self._now(tensor.is_cuda)
                return out

            return wait

        label, group_arg, peer_arg, times_group = FUNCTIONAL_OPS[name]

        def kernel(*args, **kwargs):
            tensor = first_tensor(args[0])
            ranks, backend = self._group(dist.distributed_c10d._resolve_process_group(args[group_arg]))
            size = nbytes(args[0]) * (len(ranks) if times_group else 1)
            peer = ranks[args[peer_arg]] if peer_arg is not None else None
            event = self.record(
                label, size, dtype_name(tensor), ranks, peer, backend, source_name(), async_op=True
            )
            on_cuda = self._mark_ready(event, tensor)
            _caller.in_functional = True
            try:
                out = op.redispatch(torch._C._dispatch_keys(tensor) & BELOW_BACKEND_SELECT, *args, **kwargs)
            finally:
                _caller.in_functional = False
            result = first_tensor(out)
            if result is not None:  # completes when someone waits on the result
                self._pending_functional[result.data_ptr()] = event
            else:
                event[T_END] = self._now(on_cuda)
            return out

        return kernel

    def _mark_ready(self, event: list, tensor: torch.Tensor | None) -> bool:
        """On CUDA, note when and on which stream the call is issued; returns whether it is on CUDA."""
        on_cuda = tensor is not None and tensor.is_cuda and self._cuda_clock is not None
        if on_cuda:
            event[T_READY] = self._now(True)
            stream = torch.cuda.current_stream(tensor.device)
            event[SIDE_STREAM] = stream != torch.cuda.default_stream(tensor.device)
        return on_cuda

    def _now(self, on_cuda: bool):
        """Now on the host, or (on CUDA) a timing event at this point of the current stream."""
        if not (on_cuda and self._cuda_clock is not None):
            return time.time()
        return self._cuda_clock.mark()

    def _on_completion(self, work, event: list, on_cuda: bool) -> None:
        def done(_fut):  # on CUDA this runs with the current stream waiting on the collective
            event[T_END] = self._now(on_cuda)

        if isinstance(work, torch.ScriptObject):
            work = dist.distributed_c10d.Work.unbox(work)
        if work is None:  # NCCL's synchronous calls run on the current stream and return no Work
            done(None)
            return
        try:
            future = work.get_future()
        except RuntimeError:  # gloo's send/recv/reduce_scatter have no future: stamped when waited on
            self._hold_for_wait(work, event)
            return
        future.then(done)

    def _hold_for_wait(self, work, event: list) -> None:
        """Keep the Work: pybind hands the caller this same Python object for it while it lives, so
        the caller's wait() can be matched by identity (not by kind, which gloo leaves UNKNOWN)."""
        self._unwaited[id(work)] = (work, event)
        if len(self._unwaited) > MAX_UNWAITED:
            del self._unwaited[next(iter(self._unwaited))]

    def _stamp_waited(self, work) -> None:
        """A Python `Work.wait()` returned: if it is a Work held for it, its call is complete."""
        held = self._unwaited.get(id(work))
        if held is not None and held[0] is work:
            del self._unwaited[id(work)]
            held[1][T_END] = time.time()

    def start_coalescing(self) -> None:
        self._coalescing.append([])

    def end_coalescing(self, work, device: torch.device) -> None:
        """The Work that ends an NCCL coalescing block completes every call made inside it."""
        events = self._coalescing.pop() if self._coalescing else []
        on_cuda = device.type == "cuda" and self._cuda_clock is not None
        for event in events:
            self._on_completion(work, event, on_cuda)

    def _resolve_cuda_times(self, block: bool) -> None:
        """CUDA events to wall-clock seconds: those the GPU has reached, or all of them (`block`)."""
        clock = self._cuda_clock
        if clock is None:
            return
        for e in self.events:
            for field in TIMES:
                if isinstance(e[field], Mark) and (block or clock.reached(e[field])):
                    e[field] = clock.resolve(e[field])
        clock.forget_before([e[f] for e in self.events for f in TIMES if isinstance(e[f], Mark)])


Work = dist.distributed_c10d.Work
_original_wait = Work.wait


def _wait_and_stamp(work, *args, **kwargs):
    out = _original_wait(work, *args, **kwargs)
    if _active is not None and _active._unwaited:
        _active._stamp_waited(work)
    return out


ProcessGroup = dist.ProcessGroup
_original_coalescing = (ProcessGroup._start_coalescing, ProcessGroup._end_coalescing)


def _start_coalescing(pg, device):
    if _active is not None:
        _active.start_coalescing()
    return _original_coalescing[0](pg, device)


def _end_coalescing(pg, device):
    work = _original_coalescing[1](pg, device)
    if _active is not None:
        _active.end_coalescing(work, device)
    return work


def completion_unknown(event: list) -> bool:
    return event[T_END] is None or isinstance(event[T_END], Mark)


def _unresolved(value):
    """JSON for a completion time the GPU never reached before the event had to be written."""
    if isinstance(value, Mark):
        return None
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def dtype_name(tensor: torch.Tensor | None) -> str | None:
    return str(tensor.dtype).removeprefix("torch.") if tensor is not None else None


def source_name() -> str:
    return getattr(_caller, "source", None) or "torch.distributed"


def active_profiler() -> CommProfiler | None:
    return _active


def tag_library_callers() -> None:
    """Mark calls made through deepspeed.comm as source "deepspeed" (they are still recorded once,
    at the c10d op they end in). Patched in the module namespaces DeepSpeed itself calls through
    (`from deepspeed import comm as dist; dist.all_reduce(...)`); idempotent. Only when DeepSpeed is
    already imported: importing it here would cost a stage that does not use it seconds."""
    modules = [sys.modules.get("deepspeed.comm"), sys.modules.get("deepspeed.comm.comm")]
    for module in filter(None, modules):
        for name in DEEPSPEED_COMM_API:
            fn = getattr(module, name, None)
            if fn is not None and not getattr(fn, "_hpcr1_tagged", False):
                setattr(module, name, tagged(fn, "deepspeed"))


DEEPSPEED_COMM_API = (
    "all_reduce",
    "inference_all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_base",
    "all_gather_into_tensor",
    "all_gather_coalesced",
    "allgather_fn",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_base",
    "reduce_scatter_fn",
    "all_to_all_single",
    "all_to_all",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "barrier",
    "monitored_barrier",
)


def tagged(fn, source: str):
    def call(*args, **kwargs):
        outer = getattr(_caller, "source", None)
        _caller.source = outer or source
        try:
            return fn(*args, **kwargs)
        finally:
            _caller.source = outer

    call.__name__, call.__doc__, call.__wrapped__ = fn.__name__, fn.__doc__, fn
    call._hpcr1_tagged = True
    return call
