"""Lets megatron-core 0.16.1 run on a CPU-only machine (gloo), for tests and the embedded default.

Every failure of megatron-core on CPU is a hard-coded CUDA call, not CUDA work:
`torch.cuda.current_device()` when placing rotary tables and p2p shape messages, `device="cuda"`
in the default causal mask and the pipeline schedules' token counters, and the CUDA RNG API in the
RNG tracker (whose deferred `_lazy_call` never fires without CUDA, so stream switching would
silently do nothing).

Instead of a global TorchFunctionMode (which pays on every op of every module), the few modules
that make these calls see a `torch` whose `torch.cuda` answers with the CPU device and the CPU
generator, and whose tensor factories turn a cuda device into the CPU; nothing outside those
modules changes.

On CPU the "CUDA" generator the tracker forks IS the default CPU generator, so
`model_parallel_cuda_manual_seed` reseeds it and per-TP-rank streams really switch (with dropout,
the tracker's "CPU RNG state changed within GPU RNG context" warning is then expected).

Covered: GPTModel (local spec) forward and backward, the pipeline schedules (no pipelining and
1F1B) and the RNG tracker. Not covered, because DeepSpeed replaces them in our SFT engine:
megatron's optimizer, grad clipping, DDP buffers and `tensor_parallel.broadcast_data` (verl's
megatron backend on the CPU platform adds them: stages/engines/verl_cpu_megatron.py).
Applied only when CUDA is absent; idempotent.
"""

from __future__ import annotations

import functools
import importlib
import types

import torch

# The megatron-core modules that call torch.cuda.* or build device="cuda" tensors on our paths.
PATCHED_MODULES = (
    "megatron.core.models.common.embeddings.rotary_pos_embedding",  # inv_freq on current_device()
    "megatron.core.transformer.utils",  # get_default_causal_mask: torch.ones(..., device="cuda")
    "megatron.core.utils",  # GlobalMemoryBuffer allocates on torch.cuda.current_device()
    "megatron.core.pipeline_parallel.schedules",  # token counters made with device="cuda"
    "megatron.core.pipeline_parallel.p2p_communication",  # shape exchange on current_device()
    "megatron.core.tensor_parallel.random",  # the RNG tracker's torch.cuda.get/set_rng_state
)
FACTORIES = ("zeros", "ones", "empty", "full", "tensor")


def _cpu_cuda_namespace() -> types.SimpleNamespace:
    cuda = types.SimpleNamespace(
        **{name: getattr(torch.cuda, name) for name in dir(torch.cuda) if not name.startswith("__")}
    )
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
    cuda device make CPU tensors. Other names resolve to torch's at lookup time."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _cpu_cuda_namespace()
        for name in FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


def apply_cpu_shim() -> None:
    if torch.cuda.is_available():
        return
    proxy = _TorchWithCpuCuda()
    for name in PATCHED_MODULES:
        importlib.import_module(name).torch = proxy
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    # fork() saves and restores the "cuda" generator through these two helpers; the setter would
    # defer to torch.cuda._lazy_call, which never runs without CUDA.
    random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
