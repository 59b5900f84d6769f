"""The emulated device's collective backend, "fakeccl": a Python process group that runs each
collective on the device tensors' CPU values over a gloo group of its own (built on the same store,
under a prefix of its own).

It is the default backend for the device (`dist.get_default_backend_for_device("fakegpu")`), and
`init_process_group("fakeccl")` behaves as a plain `nccl` group does: a CPU tensor in a collective is
refused with NCCL's message, object collectives and barriers travel on the device. Reductions
honour SUM, PRODUCT, MIN, MAX and AVG (gloo has no AVG: a SUM divided by the group's size). Every
collective completes before it returns, so its work and future are already done; a send or receive
completes when its work is waited for, as NCCL's do.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)
from torch.utils._pytree import tree_flatten, tree_map

from tests.fakegpu.device import DEVICE_TYPE
from tests.fakegpu.tensor import FakeGpuTensor

BACKEND = "fakeccl"


class _Done(dist._Work):
    """A completed collective: `wait` returns at once, the future holds the outputs."""

    def __init__(self, outputs):
        super().__init__()
        self._outputs = outputs

    def wait(self, timeout=None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        future.set_result(self._outputs)
        return future


class _Pending(_Done):
    """A send or receive under way on gloo, complete once waited for. Point-to-point calls return
    before the peer takes part, as NCCL's isend/irecv do: a pipeline's neighbours both post a send
    before their receive (megatron's batched p2p), which calls completed on return would deadlock."""

    def __init__(self, work, outputs):
        super().__init__(outputs)
        self._work = work

    def wait(self, timeout=None) -> bool:
        self._work.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        self.wait()
        return super().get_future()


def _values(tree):
    """The CPU values of the device tensors in `tree`; a CPU tensor is refused as NCCL refuses it."""

    def unwrap(x):
        if isinstance(x, FakeGpuTensor):
            return x._elem
        if isinstance(x, torch.Tensor):
            raise RuntimeError(f"No backend type associated with device type {x.device.type}")
        return x

    return tree_map(unwrap, tree)


def _is_avg(opts) -> bool:
    op = getattr(opts, "reduceOp", None)
    if op == dist.ReduceOp.PREMUL_SUM:
        raise NotImplementedError("fakeccl: PREMUL_SUM (NCCL-only) is not emulated")
    return op == dist.ReduceOp.AVG


def _summing(opts):
    """A copy of the reduce options `opts` with SUM for its op."""
    copy = type(opts)()
    for name in ("rootRank", "rootTensor", "timeout", "asyncOp"):
        if hasattr(opts, name):
            setattr(copy, name, getattr(opts, name))
    copy.reduceOp = dist.ReduceOp.SUM
    return copy


class FakeCCL(dist.ProcessGroup):
    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore(f"{BACKEND}/", store), rank, size, timeout)
        self._group_name = ""

    def _run(self, method: str, *args, outputs, opts=None):
        """gloo's `method` on the CPU values of `args`; `outputs` (device tensors) are the results,
        divided by the group's size when `opts` asks for an AVG."""
        average = _is_avg(opts)
        gloo_args = list(_values(args))
        if opts is not None:
            gloo_args.append(_summing(opts) if average else opts)
        getattr(self._gloo, method)(*gloo_args).wait()
        if average:
            for t in tree_flatten(outputs)[0]:
                _divide(t._elem, self.size())
        return _Done(outputs)

    # -- names: DeviceMesh and c10d read them ------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND

    def name(self) -> str:
        return BACKEND

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    @property
    def _device_types(self) -> list[torch.device]:
        # As an nccl group's: object collectives and barrier put their tensors on the device.
        return [torch.device(DEVICE_TYPE)]

    # -- collectives ---------------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        return self._run("allreduce", tensors, outputs=tensors, opts=opts or AllreduceOptions())

    def allreduce_coalesced(self, tensors, opts=None):
        for t in tensors:
            self.allreduce([t], _with_op(AllreduceOptions(), opts))
        return _Done(tensors)

    def broadcast(self, tensors, opts=None):
        return self._run("broadcast", tensors, outputs=tensors, opts=opts or BroadcastOptions())

    def reduce(self, tensors, opts=None):
        return self._run("reduce", tensors, outputs=tensors, opts=opts or ReduceOptions())

    def allgather(self, output_lists, inputs, opts=None):
        return self._run(
            "allgather", output_lists, inputs, outputs=output_lists, opts=opts or AllgatherOptions()
        )

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        for outputs, tensor in zip(output_lists, inputs):
            self.allgather([outputs], [tensor])
        return _Done(output_lists)

    def _allgather_base(self, output, input, opts=None):
        return self._run("_allgather_base", output, input, outputs=[output], opts=opts or AllgatherOptions())

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for output, tensor in zip(outputs, inputs):
            self._allgather_base(output, tensor)
        return _Done(outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        return self._run(
            "reduce_scatter", outputs, input_lists, outputs=outputs, opts=opts or ReduceScatterOptions()
        )

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts or ReduceScatterOptions()
        return self._run("_reduce_scatter_base", output, input, outputs=[output], opts=opts)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        for output, tensor in zip(outputs, inputs):
            self._reduce_scatter_base(output, tensor, _with_op(ReduceScatterOptions(), opts))
        return _Done(outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def gather(self, output_lists, inputs, opts=None):
        return self._run("gather", output_lists, inputs, outputs=output_lists, opts=opts or GatherOptions())

    def scatter(self, outputs, input_lists, opts=None):
        return self._run("scatter", outputs, input_lists, outputs=outputs, opts=opts or ScatterOptions())

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts or AllToAllOptions()
        return self._run(
            "alltoall_base", output, input, output_split_sizes, input_split_sizes, outputs=[output], opts=opts
        )

    all_to_all_single = alltoall_base

    def alltoall(self, outputs, inputs, opts=None):
        return self._run("alltoall", outputs, inputs, outputs=outputs, opts=opts or AllToAllOptions())

    def send(self, tensors, dst: int, tag: int = 0):
        return _Pending(self._gloo.send(_values(tensors), dst, tag), tensors)

    def recv(self, tensors, src: int, tag: int = 0):
        return _Pending(self._gloo.recv(_values(tensors), src, tag), tensors)

    def barrier(self, opts=None):
        self._gloo.barrier(BarrierOptions()).wait()  # gloo's own: its device is the CPU
        return _Done([])

    # -- coalescing: every call is complete already --------------------------------------------------
    def _start_coalescing(self, device=None) -> None:
        pass

    start_coalescing = _start_coalescing

    def _end_coalescing(self, device=None):
        return _Done([])

    end_coalescing = _end_coalescing

    def shutdown(self) -> None:
        self._gloo.shutdown()


def _with_op(single, opts):
    """`single` (one tensor's options) with the reduce op of a coalesced call's `opts`."""
    single.reduceOp = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
    return single


def _divide(values: torch.Tensor, size: int) -> None:
    if values.is_floating_point() or values.is_complex():
        values.div_(size)
    else:
        values.floor_divide_(size)


def create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> FakeCCL:
    return FakeCCL(store, rank, size, timeout)


def register_backend() -> None:
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, create, devices=[DEVICE_TYPE])
