"""mpi4py calls recorded with the same schema as torch.distributed's (source "mpi").

`ProfiledComm(MPI.COMM_WORLD)` behaves like the communicator it wraps; the calls the pipeline makes
(buffer API: Allreduce, Bcast, Reduce, Gather, Allgather, Scatter, Alltoall, Send, Recv; object API:
allreduce, bcast, gather, allgather, send, recv; Barrier) are recorded into the active CommProfiler.
Buffer sizes are exact; the object API's size is its pickle's (what mpi4py sends; for a gather, the
pickles of every piece). Anything else is passed through unrecorded.

Calls made before a profiler exists (the rank discovery, runtime/mpi_bootstrap.py) go into a
`CallLog` instead, which hands them to the profiler once it starts, with their own times.
"""

from __future__ import annotations

import pickle
import time

import numpy as np

from runtime.comm_profiler import FIELDS, active_profiler

PHASE, STEP, BYTES, T_START, T_END = (FIELDS.index(f) for f in ("phase", "step", "bytes", "t_start", "t_end"))

# method -> (op name, index of the peer argument or None)
BUFFER_CALLS = {
    "Allreduce": ("all_reduce", None),
    "Bcast": ("broadcast", None),
    "Reduce": ("reduce", None),
    "Gather": ("gather", None),
    "Allgather": ("all_gather", None),
    "Scatter": ("scatter", None),
    "Alltoall": ("all_to_all", None),
    "Send": ("send", 1),
    "Recv": ("recv", 1),
    "Barrier": ("barrier", None),
}
OBJECT_CALLS = {
    "allreduce": ("all_reduce", None),
    "bcast": ("broadcast", None),
    "gather": ("gather", None),
    "allgather": ("all_gather", None),
    "send": ("send", 1),
    "recv": ("recv", 1),
    "barrier": ("barrier", None),
}
WHOLE_FROM_PIECE = {"gather", "all_gather", "scatter"}  # S = the whole array, n pieces


def array_of(spec) -> np.ndarray:
    """mpi4py buffer specs: an array, or [array, MPI datatype], or (array, count, datatype)."""
    return np.asarray(spec[0] if isinstance(spec, (list, tuple)) else spec)


def buffer_size(op: str, args: tuple, n: int) -> tuple[int, str | None]:
    """S in nccl-tests' terms: the send buffer (the receive buffer when sending IN_PLACE or, for
    Scatter, always), times n where only one piece is in hand."""
    from mpi4py import MPI

    if not args or op == "barrier":
        return 0, None
    in_place = args[0] is MPI.IN_PLACE or args[0] is None
    use_recv = op == "scatter" or in_place
    array = array_of(args[1] if use_recv else args[0])
    piece_only = op in WHOLE_FROM_PIECE and not (in_place and op != "scatter")
    return array.nbytes * (n if piece_only else 1), str(array.dtype)


def pickled_size(obj) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def object_size(op: str, sent, received, n: int) -> int:
    """What an object call moved: the pickle that arrived for recv and bcast (not what this rank passed
    in), every piece's for a gather (S is the whole, as for buffers), else the pickle sent. A gather's
    non-root ranks see only their own piece: n of its size."""
    if op in ("recv", "broadcast"):
        return pickled_size(received)
    if op in WHOLE_FROM_PIECE:
        return sum(map(pickled_size, received)) if received is not None else n * pickled_size(sent)
    return pickled_size(sent)


class CallLog:
    """Stands in for the CommProfiler where none exists yet: keeps each call's arguments to `record`
    and its event (sizes and times), so that `hand_to` records them in the profiler once it starts."""

    def __init__(self):
        self.calls: list[tuple[tuple, list]] = []

    def record(self, *args) -> list:
        event = [None] * len(FIELDS)
        event[BYTES], event[T_START] = args[1], time.time()
        self.calls.append((args, event))
        return event

    def hand_to(self, profiler, phase: str) -> None:
        """Record the kept calls in `profiler` as calls of `phase` in step 0 (before the stage's steps),
        with the sizes and times they had; the profiler numbers them (seq) before its own calls."""
        for args, kept in self.calls:
            event = profiler.record(*args)
            event[PHASE], event[STEP] = phase, 0
            event[BYTES], event[T_START], event[T_END] = kept[BYTES], kept[T_START], kept[T_END]
        self.calls = []


class ProfiledComm:
    def __init__(self, comm, recorder=None):
        """`recorder`: where calls are recorded (a CallLog); by default the active CommProfiler at the
        time of the call, none (unrecorded) if there is none."""
        from mpi4py import MPI

        self._comm, self._recorder = comm, recorder
        world = comm.Get_group().Translate_ranks(list(range(comm.Get_size())), MPI.COMM_WORLD.Get_group())
        self.group_ranks = tuple(int(r) for r in world)

    def __getattr__(self, name):
        call = getattr(self._comm, name)
        if name in BUFFER_CALLS:
            return self._recorded(call, *BUFFER_CALLS[name], objects=False)
        if name in OBJECT_CALLS:
            return self._recorded(call, *OBJECT_CALLS[name], objects=True)
        return call

    def _recorded(self, call, op: str, peer_arg: int | None, objects: bool):
        def run(*args, **kwargs):
            prof = self._recorder or active_profiler()
            if prof is None:
                return call(*args, **kwargs)
            n = len(self.group_ranks)
            sent = args[0] if args else kwargs.get("obj")
            if objects:
                nbytes, dtype = (0 if op == "barrier" else pickled_size(sent)), "pickle"
            else:
                nbytes, dtype = buffer_size(op, args, n)
            peer = (
                args[peer_arg]
                if peer_arg is not None and len(args) > peer_arg
                else kwargs.get("dest", kwargs.get("source"))
            )
            peer = self.group_ranks[peer] if isinstance(peer, int) and peer >= 0 else None
            event = prof.record(op, nbytes, dtype, self.group_ranks, peer, "mpi", "mpi")
            out = call(*args, **kwargs)
            if objects and op != "barrier":
                event[BYTES] = object_size(op, sent, out, n)
            event[T_END] = time.time()
            return out

        return run
