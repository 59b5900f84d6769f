"""Moving a module's parameters onto the emulated device keeps each parameter object, as a move to
CUDA does: `module.to("fakegpu")`, and FSDP2's `fully_shard` of a module still on the CPU.

On CUDA both move a parameter with `param.data = moved` (CPU and CUDA tensors are of one kind), so
an optimizer made before the move - DeepSpeed's engine moves the model it is given, after the caller
made the optimizer - still holds the module's parameters. A plain tensor's `.data` cannot take a
wrapper, so moves onto the emulated device are sent down the other identity-keeping path both
callers have, torch.utils.swap_tensors (which they take for traceable tensor subclasses). That swap
is allowed for parameters that weakrefs point at (DeepSpeed's and megatron's do: the weakrefs keep
pointing at the same object, as after CUDA's `.data`), and the parameter keeps its own attributes,
as after `.data`. Moves between device tensors keep the `.data` path (the wrapper's setter).
"""

from __future__ import annotations

import contextlib
import sys
import types
from types import ModuleType

import torch
import torch.nn.modules.module as module
import torch.utils

from tests.fakegpu.device import DEVICE_TYPE
from tests.fakegpu.tensor import FakeGpuTensor

FSDP_INIT = "torch.distributed.fsdp._fully_shard._fsdp_init"  # _move_states_to_device


def _onto_the_device(moved, original) -> bool:
    return isinstance(moved, FakeGpuTensor) and not isinstance(original, FakeGpuTensor)


def _module_apply_moves_onto_the_device(moved, caller: dict) -> bool:
    """Module._apply asks about the moved tensor; the one it moved is its local `param`."""
    return _onto_the_device(moved, caller.get("param"))


def _fsdp_moves_onto_the_device(original, caller: dict) -> bool:
    """FSDP2 asks about the tensor it is about to move to its local `device`."""
    device = caller.get("device")
    return not isinstance(original, FakeGpuTensor) and getattr(device, "type", None) == DEVICE_TYPE


def _swapping(traceable, onto_the_device):
    """`traceable` (is_traceable_wrapper_subclass, as the caller imported it), also true for a move
    onto the device."""
    if getattr(traceable, "fakegpu", False):
        return traceable

    def swap_onto_the_device(t) -> bool:
        return traceable(t) or onto_the_device(t, sys._getframe(1).f_locals)

    swap_onto_the_device.fakegpu = True
    return swap_onto_the_device


@contextlib.contextmanager
def _weakrefs_unseen():
    """swap_tensors refuses tensors with weakrefs; it finds them through its module's `weakref`."""
    seen = torch.utils.weakref
    torch.utils.weakref = types.SimpleNamespace(getweakrefs=lambda obj: [])
    try:
        yield
    finally:
        torch.utils.weakref = seen


def _swap_keeping_the_parameter(swap):
    if getattr(swap, "fakegpu", False):
        return swap

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

    swap_tensors.fakegpu = True
    return swap_tensors


def keep_parameters_on_move() -> None:
    """Module._apply's moves onto the device go through swap_tensors, which keeps the parameter's
    weakrefs and attributes (idempotent)."""
    torch.utils.swap_tensors = _swap_keeping_the_parameter(torch.utils.swap_tensors)
    module.is_traceable_wrapper_subclass = _swapping(
        module.is_traceable_wrapper_subclass, _module_apply_moves_onto_the_device
    )


def patch_fsdp_init(fsdp_init: ModuleType) -> None:
    """FSDP2's move of a CPU module's states onto the device goes through swap_tensors too."""
    fsdp_init.is_traceable_wrapper_subclass = _swapping(
        fsdp_init.is_traceable_wrapper_subclass, _fsdp_moves_onto_the_device
    )
