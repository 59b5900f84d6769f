"""megatron-core on the emulated device: the project's CPU shim (stages/engines/cpu_shim.py) gives
the megatron modules that hard-code CUDA calls a `torch` whose `torch.cuda` answers with the CPU.
Under the harness those calls answer with the rank's emulated device instead - `current_device()`
and factories asked for `device="cuda"` - so megatron's tensors land where a GPU run's would (RNG
calls still go to the CPU generator, which is the emulated device's). Installed in place of
`cpu_shim.apply_cpu_shim`, so the SFT engine applies it where it applied the CPU shim."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from tests.fakegpu.device import on_index


def _on_fakegpu(factory):
    @functools.wraps(factory)
    def make(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = on_index(torch.device(device))
        return factory(*args, **kwargs)

    return make


def install(cpu_shim: ModuleType) -> None:
    """Replace `cpu_shim.apply_cpu_shim` (its module just imported) by the emulated device's."""
    apply_cpu_shim = cpu_shim.apply_cpu_shim
    if getattr(apply_cpu_shim, "fakegpu", False):
        return

    class TorchWithFakeGpuCuda(cpu_shim._TorchWithCpuCuda):
        def __init__(self):
            super().__init__()
            self.cuda.current_device = on_index
            for name in cpu_shim.FACTORIES:
                setattr(self, name, _on_fakegpu(getattr(torch, name)))

    def apply_fakegpu_shim() -> None:
        apply_cpu_shim()  # the CPU shim's RNG redirection, then our devices over its
        proxy = TorchWithFakeGpuCuda()
        for name in cpu_shim.PATCHED_MODULES:
            importlib.import_module(name).torch = proxy

    apply_fakegpu_shim.fakegpu = True
    cpu_shim.apply_cpu_shim = apply_fakegpu_shim
