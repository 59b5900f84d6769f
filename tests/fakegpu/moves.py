"""`module.to("fakegpu")` keeps each parameter object, as a move to CUDA does.

On CUDA, Module._apply moves a parameter with `param.data = moved` (CPU and CUDA tensors are of one
kind), so an optimizer made before the move - DeepSpeed's engine moves the model it is given, after
the caller made the optimizer - still holds the module's parameters. A plain tensor's `.data` cannot
take a wrapper, so for moves onto the emulated device Module._apply is sent down its other
identity-keeping path, torch.utils.swap_tensors (the one it takes for traceable tensor subclasses).
That swap is allowed for parameters that weakrefs point at (DeepSpeed's and megatron's do: the
weakrefs keep pointing at the same object, as after CUDA's `.data`), and the parameter keeps its own
attributes, as after `.data`. Moves between device tensors keep the `.data` path (the wrapper's
setter).
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch
import torch.nn.modules.module as module
import torch.utils

from tests.fakegpu.tensor import FakeGpuTensor


def _onto_the_device(moved, original) -> bool:
    return isinstance(moved, FakeGpuTensor) and not isinstance(original, FakeGpuTensor)


@contextlib.contextmanager
def _weakrefs_unseen():
    """swap_tensors refuses tensors with weakrefs; it finds them through its module's `weakref`."""
    seen = torch.utils.weakref
    torch.utils.weakref = types.SimpleNamespace(getweakrefs=lambda obj: [])
    try:
        yield
    finally:
        torch.utils.weakref = seen


def keep_parameters_on_move() -> None:
    """Send Module._apply's moves onto the device down swap_tensors, and let that swap keep the
    parameter's weakrefs and attributes (idempotent)."""
    traceable, swap = module.is_traceable_wrapper_subclass, torch.utils.swap_tensors
    if getattr(traceable, "fakegpu", False):
        return

    def swap_onto_the_device(t) -> bool:
        # Module._apply asks about the moved tensor only; the one it moved is its local `param`.
        return traceable(t) or _onto_the_device(t, sys._getframe(1).f_locals.get("param"))

    def swap_tensors(t1, t2):
        if not _onto_the_device(t2, t1):
            return swap(t1, t2)
        # swap_tensors swaps __dict__s; `.data` on CUDA keeps the parameter's own attributes (megatron's
        # tensor_model_parallel, which the gradient norm reads, DeepSpeed's marks): keep them too.
        attributes = dict(t1.__dict__)
        with _weakrefs_unseen():
            swap(t1, t2)
        for name, value in attributes.items():
            t1.__dict__.setdefault(name, value)

    swap_onto_the_device.fakegpu = True
    module.is_traceable_wrapper_subclass = swap_onto_the_device
    torch.utils.swap_tensors = swap_tensors
