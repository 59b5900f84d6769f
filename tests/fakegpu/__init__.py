"""An emulated accelerator for the tests: the device "fakegpu" and its collective backend "fakeccl".

A run on it fails where a GPU run would fail for a device mistake - a CPU batch into a model on the
device, a CPU tensor in a collective of the device's group, tensors of two devices in one op - while
the values are computed on the CPU and checked like any others. PyTorch finds it as it finds CUDA:
`torch.accelerator.current_accelerator()` is fakegpu, `torch.accelerator.set_device_index(local_rank)`
selects a rank's device, `dist.get_default_backend_for_device("fakegpu")` is "fakeccl". DDP, FSDP2,
DeepSpeed ZeRO 0-2 and megatron-core (through the project's CPU shim) run on it. Its memory is what a
GPU's would be where torch's code paths are CUDA's: its optimizers take their foreach kernels (and
temporaries), DeepSpeed's typed tensors are made on it.

In this process:   `from tests import fakegpu; fakegpu.install()`
In torchrun ranks: `env = fakegpu.child_env(env)`; a process started with that environment installs
                   it at startup (boot/sitecustomize.py), before any of its own code runs.

Not emulated (each fails loudly rather than differ silently): `torch.autocast("fakegpu")`, pinned
host memory, `torch.Generator(device="fakegpu")` (the CPU generator computes the device's random
numbers), and `param.data = cpu_tensor` on a device parameter (CUDA allows it; here it raises).
Differences left: a device tensor's `untyped_storage()` is its values' CPU storage (shared by views,
as on a GPU, but its device says cpu), and gloo groups take device tensors for every collective.

Parts: guard.cpp (device index and count), device.py (`torch.fakegpu`), ledger.py (device
memory), tensor.py (the device's tensors and kernels), moves.py (Module.to keeps parameters),
ccl.py (the process group), fsdp.py, deepspeed_accel.py and megatron_shim.py (what each engine
needs). Every op pays a Python dispatch: keep emulated runs to tiny models and few steps.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

from tests.fakegpu import ccl, device, fsdp, moves, tensor
from tests.fakegpu.ccl import BACKEND
from tests.fakegpu.device import DEVICE_TYPE
from tests.fakegpu.guard import load_guard
from tests.fakegpu.imports import after_import
from tests.fakegpu.tensor import FakeGpuTensor, to_device

__all__ = ["BACKEND", "DEVICE_TYPE", "ENV_VAR", "FakeGpuTensor", "child_env", "install", "to_device"]

ENV_VAR = "HPCR1_FAKEGPU"  # "1": install at interpreter startup (boot/sitecustomize.py)
COUNT_VAR = "HPCR1_FAKEGPU_DEVICES"  # how many devices a process sees (default: below)
BOOT = Path(__file__).with_name("boot")
REPO = Path(__file__).resolve().parents[2]


def installed() -> bool:
    return torch._C._get_privateuse1_backend_name() == DEVICE_TYPE


def install(device_count: int | None = None) -> None:
    """Register the device, its kernels and backend, and the engines' adjustments (idempotent).
    `device_count`: the devices this process sees; default $HPCR1_FAKEGPU_DEVICES, else torchrun's
    LOCAL_WORLD_SIZE (a node with a device a rank), else 2."""
    if installed():
        return
    count = device_count or int(os.environ.get(COUNT_VAR) or os.environ.get("LOCAL_WORLD_SIZE") or 2)
    load_guard(count)  # first: PyTorch keeps the first device guard registered
    device.set_device_count(count)
    _setup_privateuseone_for_python_backend(DEVICE_TYPE, backend_module=device)
    device.answer_accelerator_memory()
    tensor.register_kernels()
    tensor.take_foreach_paths()
    moves.keep_parameters_on_move()
    ccl.register_backend()
    after_import(fsdp.PARAM_MODULE, fsdp.patch)
    after_import(fsdp.GROUP_MODULE, fsdp.patch)
    after_import(moves.FSDP_INIT, moves.patch_fsdp_init)
    after_import("deepspeed.accelerator.real_accelerator", _install_deepspeed_accelerator)
    after_import("stages.engines.cpu_shim", _install_megatron_shim)


def _install_deepspeed_accelerator(real_accelerator) -> None:
    from tests.fakegpu import deepspeed_accel  # imports DeepSpeed: only once DeepSpeed is in use

    deepspeed_accel.install(real_accelerator)


def _install_megatron_shim(cpu_shim) -> None:
    from tests.fakegpu import megatron_shim

    megatron_shim.install(cpu_shim)


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) for processes that run on the emulated device: torchrun and
    its ranks, the CLI and the stages it starts."""
    env = dict(os.environ if env is None else env)
    env[ENV_VAR] = "1"
    # The repository right after boot/: verl installs a `tests` package of its own.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BOOT), str(REPO), env.get("PYTHONPATH")]))
    return env
