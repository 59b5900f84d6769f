"""mpi4py calls recorded with the same schema as torch.distributed's (source "mpi").

`ProfiledComm(MPI.COMM_WORLD)` behaves like the communicator it wraps; the calls the pipeline makes
(buffer API: Allreduce, Bcast, Reduce, Gather, Allgather, Scatter, Alltoall, Send, Recv; object API:
allreduce, bcast, gather, allgather, send, recv; Barrier) are recorded into the active CommProfiler.
Buffer sizes are exact; the object API's size is its pickle's (what mpi4py sends). Anything else
is passed through unrecorded.
"""

from __future__ import annotations

import pickle
import time

import numpy as np

from runtime.comm_profiler import T_END, active_profiler

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


class ProfiledComm:
    def __init__(self, comm):
        from mpi4py import MPI

        self._comm = comm
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
            prof = active_profiler()
            if prof is None:
                return call(*args, **kwargs)
            if objects:
                nbytes, dtype = (pickled_size(args[0]) if args else 0), "pickle"
            else:
                nbytes, dtype = buffer_size(op, args, len(self.group_ranks))
            peer = (
                args[peer_arg]
                if peer_arg is not None and len(args) > peer_arg
                else kwargs.get("dest", kwargs.get("source"))
            )
            peer = self.group_ranks[peer] if isinstance(peer, int) and peer >= 0 else None
            event = prof.record(op, nbytes, dtype, self.group_ranks, peer, "mpi", "mpi")
            out = call(*args, **kwargs)
            if objects and op in ("recv", "broadcast"):  # what arrived, not what this rank passed in
                event[5] = pickled_size(out)
            event[T_END] = time.time()
            return out

        return run
