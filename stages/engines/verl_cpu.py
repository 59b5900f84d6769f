"""verl on CPU: a platform for test clusters without GPUs (the `local` and `local-multinode`
Slurm profiles), so that verl's own trainer and generation server run there as they do on GPUs.
Never selected on a GPU cluster: a profile with GPUs refuses it (core/cluster.py).

verl imports this module in every process it starts, Ray workers included, when it is among
`VERL_USE_EXTERNAL_MODULES` (verl/__init__.py; verl_trainer.verl_process_env), and selects the platform by
`VERL_PLATFORM=cpu` (verl/plugin/platform/platform_manager.py). Both reach the workers through Ray's
runtime environment (launch/verl_job.py). Ray counts the ranks as "GPU" resources: the job's Ray
is started with as many fake GPUs a node as the profile has ranks a node.

Where verl 0.9.1 assumes an accelerator, `patch_verl()` adapts it; each patch names the line.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from types import ModuleType

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

from stages.engines.verl_import_hooks import after_import, before_import
from stages.engines.verl_platform_names import CPU_PLATFORM as PLATFORM
from stages.engines.verl_platform_names import CPU_ROLLOUT as ROLLOUT  # stages/engines/verl_hf_rollout.py


@PlatformRegistry.register(platform=PLATFORM)
class PlatformCPU(PlatformBase):
    """torch's CPU device and gloo; memory, streams and profiler ranges have nothing to do."""

    device_name = PLATFORM
    vendor_name = PLATFORM

    @property
    def device_module(self):
        return _CPU_DEVICE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return False  # chosen only by VERL_PLATFORM, never detected

    def current_device(self):
        return PLATFORM  # verl moves tensors with .to(current_device()): an index would mean CUDA

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"  # what Ray sets for its (fake) GPU resources

    def nvtx_range(self, msg: str):
        return contextlib.nullcontext()

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "GPU"  # verl's resource pools and placement groups then work unchanged

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


class _CPUDevice:
    """torch.cpu with the calls verl makes on its device module that torch.cpu lacks (memory
    statistics, empty_cache, seeding): nothing to free, nothing to count."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    def __eq__(self, other) -> bool:  # verl's own CPU cases test `device == torch.cpu`
        return other is self or other is torch.cpu

    __hash__ = object.__hash__

    def get_device_name(self, device=None) -> str:
        return "CPU"

    def empty_cache(self) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    # utils/checkpoint/checkpoint_manager.py:218 restores the device's RNG state when its name is
    # among the saved ones, and "cpu" always is: on the CPU that is torch's own generator.
    def get_rng_state(self, device=None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device=None) -> None:
        torch.set_rng_state(state)

    def mem_get_info(self, device=None) -> tuple[int, int]:
        return 0, 0

    def memory_allocated(self, device=None) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    def reset_peak_memory_stats(self, device=None) -> None:
        pass


_CPU_DEVICE = _CPUDevice()


def _gloo_only(init):
    """verl/utils/distributed.py:63,89 build "cpu:gloo,<device>:<ccl>", here "cpu:gloo,cpu:gloo",
    which torch rejects: one device, one backend."""

    @functools.wraps(init)
    def wrapper(*args, **kwargs):
        if kwargs.get("backend") is None and len(args) < 2:
            kwargs["backend"] = "gloo"
        return init(*args, **kwargs)

    return wrapper


def patch_verl() -> None:
    import verl.utils.distributed as distributed
    import verl.utils.import_utils as import_utils

    distributed.initialize_global_process_group_ray = _gloo_only(
        distributed.initialize_global_process_group_ray
    )
    # models/transformers/monkey_patch.py:352 imports a value-head model from any trl it finds; the
    # trl of the CPU lock has none, and GRPO has no critic.
    import_utils.is_trl_available = lambda: False
    # verl's own override of the device its engine registry looks up (workers/engine/base.py:405):
    # transformer_impl.py:1143 registers the FSDP engines for cuda and npu only, their code is generic.
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"
    after_import("verl.workers.engine.fsdp.transformer_impl", _patch_fsdp_engine)
    # The HF rollout under the name 'hf', beside vLLM's in both of verl's registries, in the
    # processes that look it up: the replicas' (workers/rollout/replica.py:388) and the trainer-side
    # adapter's (workers/rollout/base.py:81).
    after_import("verl.workers.rollout.replica", _register_replica)
    after_import("verl.workers.rollout.base", _register_adapter)
    _patch_megatron_backend()


# --- the megatron backend (model_engine=megatron) -------------------------------------------------

# Transformer Engine's torch wheel loads its core library at import, which links libcuda
# (transformer_engine/common/__init__.py:360): with no driver that is an OSError, which the
# `except ImportError` guards of megatron-core (core/utils.py:56-64 and ~20 more) and Megatron-Bridge
# do not catch. On the CPU platform TE is absent, as megatron-core can run without it.
TRANSFORMER_ENGINE = ("transformer_engine", "transformer_engine_torch")
# Megatron-Bridge modules that import TE unconditionally, for LoRA only, and are reached from
# `import megatron.bridge` (bridge/__init__.py:16 -> ... -> peft/lora_layers.py:20, peft/lora.py:22).
BRIDGE_TE_IMPORTERS = ("megatron.bridge.peft.lora_layers", "megatron.bridge.peft.lora")


def _patch_megatron_backend() -> None:
    for name in TRANSFORMER_ENGINE:
        sys.modules.setdefault(name, None)  # `import` raises ImportError; find_spec answers None
    for name in BRIDGE_TE_IMPORTERS:
        before_import(name, _see_absent_transformer_engine)
    after_import("verl.workers.engine.megatron.transformer_impl", _patch_megatron_engine)


def _patch_megatron_engine(transformer_impl: ModuleType) -> None:
    # Without Megatron-Bridge (the CPU .venv) verl's megatron engine can build no model and is never
    # chosen (launch/verl_job.py refuses it); failing here would fail its import, which verl retries
    # from engine/__init__.py:65 after mindspeed's attempt, registering it twice (base.py:389).
    if importlib.util.find_spec("megatron.bridge") is None:
        return
    from stages.engines.verl_cpu_megatron import patch_megatron

    patch_megatron()


def _see_absent_transformer_engine(module: ModuleType) -> None:
    """`module`'s own imports of transformer_engine get a stand-in whose every name is a class
    that cannot be instantiated (its LoRA classes subclass them; nothing on our path builds one);
    no other module sees it, so megatron-core still finds TE absent."""
    import builtins

    def importer(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name.split(".")[0] == "transformer_engine":
            stand_in = _ABSENT_TE
            for part in name.split(".")[1:] if fromlist else ():
                stand_in = getattr(stand_in, part)
            return stand_in
        return builtins.__import__(name, globals, locals, fromlist, level)

    module.__builtins__ = {**builtins.__dict__, "__import__": importer}


class _AbsentMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _absent(f"{cls.__qualname__}.{name}")


def _absent(qualname: str) -> type:
    def refuse(self, *args, **kwargs):
        raise RuntimeError(f"{qualname}: Transformer Engine is not available on the CPU platform")

    return _AbsentMeta(qualname, (), {"__init__": refuse, "__qualname__": qualname})


class _AbsentModule(ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _absent(f"{self.__name__}.{name}")


_ABSENT_TE = _AbsentModule("transformer_engine")
_ABSENT_TE.pytorch = _AbsentModule("transformer_engine.pytorch")


def _register_replica(replica: ModuleType) -> None:
    def load():
        from stages.engines.verl_hf_rollout import HFReplica

        return HFReplica

    replica.RolloutReplicaRegistry.register(ROLLOUT, load)


def _register_adapter(base: ModuleType) -> None:
    base._ROLLOUT_REGISTRY[(ROLLOUT, "async")] = "stages.engines.verl_hf_rollout.HFServerAdapter"


def _patch_fsdp_engine(transformer_impl: ModuleType) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy

    # transformer_impl.py:462 gives forward-only models (the reference) pinned CPU offload: pinning
    # needs an accelerator.
    transformer_impl.CPUOffloadPolicy = lambda pin_memory=True: CPUOffloadPolicy(pin_memory=False)
    # transformer_impl.py:882-886 move a model whose parameters are on the CPU "to the GPU" before
    # a checkpoint (fsdp_utils.py:237, model.to(device)): on the CPU that swaps the parameters in
    # place, which torch refuses once anything holds a reference to them (the profiler does).
    transformer_impl.load_fsdp_model_to_gpu = lambda model: None
    transformer_impl.offload_fsdp_model_to_cpu = lambda model, empty_cache=True: None


patch_verl()
