"""FSDP2 on the emulated device: it frees an unsharded parameter after use and allocates it again
before the next all-gather by resizing the tensor's storage in place (`free_storage` and
`alloc_storage` in torch/distributed/fsdp/_fully_shard/_fsdp_param.py). A device tensor's own
storage is a placeholder, so for them both resize the CPU storage that holds the values instead:
a freed parameter really is gone (reading it fails, as on a GPU), and the ledger counts it so."""

from __future__ import annotations

import functools
from types import ModuleType

from tests.fakegpu.ledger import LEDGER
from tests.fakegpu.tensor import FakeGpuTensor

PARAM_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_param"
GROUP_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_param_group"  # imports alloc_storage by name


def _on_values(resize):
    @functools.wraps(resize)
    def resize_values(tensor):
        if not isinstance(tensor, FakeGpuTensor):
            return resize(tensor)
        resize(tensor._elem)
        LEDGER.resized(tensor._elem.untyped_storage())

    resize_values.fakegpu = True
    return resize_values


def patch(module: ModuleType) -> None:
    for name in ("free_storage", "alloc_storage"):
        original = getattr(module, name, None)
        if original is not None and not getattr(original, "fakegpu", False):
            setattr(module, name, _on_values(original))
