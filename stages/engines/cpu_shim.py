"""Lets megatron-core 0.16 run on a CPU-only machine (gloo), for tests and the embedded default.

megatron-core's CPU failures are all hard-coded CUDA calls, not CUDA work (notes/cpu-facts.md):
`torch.cuda.current_device()` when placing rotary tables, and the CUDA RNG API in its RNG tracker
(whose deferred `_lazy_call` never fires without CUDA, so stream switching would silently do
nothing). Instead of a global TorchFunctionMode (a cost on every op), the modules that make these
calls get a `torch` whose `torch.cuda` answers with the CPU device and the CPU generator; nothing
outside those modules changes. Applied only when CUDA is absent; idempotent.
"""
from __future__ import annotations

import functools
import importlib
import types

import torch

# The megatron-core modules that call torch.cuda.* on paths we use.
PATCHED_MODULES = (
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.tensor_parallel.random",
    "megatron.core.utils",  # GlobalMemoryBuffer allocates on torch.cuda.current_device()
    "megatron.core.pipeline_parallel.schedules",  # token counters made with device="cuda"
    "megatron.core.pipeline_parallel.p2p_communication",  # shape exchange on current_device()
)
FACTORIES = ("zeros", "ones", "empty", "full", "tensor")


def _cpu_cuda_namespace() -> types.SimpleNamespace:
    cuda = types.SimpleNamespace(**{name: getattr(torch.cuda, name) for name in dir(torch.cuda)
                                    if not name.startswith("__")})
    cuda.current_device = lambda: torch.device("cpu")
    cuda.get_rng_state = lambda device=None: torch.get_rng_state()
    cuda.set_rng_state = lambda state, device=None: torch.set_rng_state(state)
    cuda.manual_seed = torch.manual_seed
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    return cuda


def _on_cpu(factory):
    @functools.wraps(factory)
    def make(*args, **kwargs):
        if "device" in kwargs and torch.device(kwargs["device"]).type == "cuda":
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return make


class _TorchWithCpuCuda(types.ModuleType):
    """`torch`, except that `.cuda` is the CPU stand-in above and tensor factories asked for a
    cuda device make CPU tensors."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _cpu_cuda_namespace()
        for name in FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


@functools.lru_cache
def _causal_mask_on_cpu(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


# Functions that build tensors with a literal device="cuda", by every module that imported them.
REPLACED_FUNCTIONS = {
    ("megatron.core.transformer.utils", "get_default_causal_mask"): _causal_mask_on_cpu,
    ("megatron.core.fusions.fused_softmax", "get_default_causal_mask"): _causal_mask_on_cpu,
}


def apply_cpu_shim() -> None:
    if torch.cuda.is_available():
        return
    proxy = _TorchWithCpuCuda()
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        module.torch = proxy
    for (module_name, function), replacement in REPLACED_FUNCTIONS.items():
        setattr(importlib.import_module(module_name), function, replacement)
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    # The tracker saves and restores the "cuda" generator through these two helpers.
    random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
