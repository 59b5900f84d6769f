"""The emulated device's runtime module, registered as `torch.fakegpu`: what engines call on a
device module (`torch.get_device_module(device)`, FSDP2's and DeviceMesh's device handle,
DeepSpeed's accelerator), answered as `torch.cuda` would answer it.

The device runs every op when it is issued, so streams and events are complete at once (they
still record times: `Event.elapsed_time` works). Its random numbers come from the CPU generator,
which computes them. Memory is the ledger's count (ledger.py).
"""

from __future__ import annotations

import contextlib

import torch

from tests.fakegpu.ledger import LEDGER

DEVICE_TYPE = "fakegpu"
TOTAL_MEMORY = 80 << 30  # what mem_get_info reports, as an 80 GiB GPU
_count = 1  # devices this process sees: install() sets it


def index_of(device: torch.device | str | int | None = None) -> int:
    """The device index that `device` names, the current one when it names none (as CUDA)."""
    if isinstance(device, int):
        return device
    index = None if device is None else torch.device(device).index
    return torch.accelerator.current_device_index() if index is None else index


def on_index(device: torch.device | str | int | None = None) -> torch.device:
    """The device `device` names, which must exist (as CUDA checks the ordinal)."""
    index = index_of(device)
    if not 0 <= index < _count:
        raise RuntimeError(f"fakegpu error: invalid device ordinal {index} ({_count} devices)")
    return torch.device(DEVICE_TYPE, index)


# -- devices --------------------------------------------------------------------------------------
def set_device_count(count: int) -> None:
    global _count
    _count = count


def device_count() -> int:
    return _count


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def current_device() -> int:
    return torch.accelerator.current_device_index()


def set_device(device: torch.device | str | int) -> None:
    torch.accelerator.set_device_index(index_of(device))


def device(device: torch.device | str | int | None):
    """`with torch.fakegpu.device(i):` as `torch.cuda.device`."""
    return torch.accelerator.device_index(None if device is None else index_of(device))


def get_device_name(device=None) -> str:
    return "Emulated GPU (fakegpu)"


def get_device_capability(device=None) -> tuple[int, int]:
    return (9, 0)  # an H100's, so that code choosing kernels by capability takes the modern path


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16]


# -- streams and events ---------------------------------------------------------------------------
def Stream(device=None, priority: int = 0, **kwargs) -> torch.Stream:  # noqa: N802 (torch.cuda's name)
    """A stream of the emulated device, as `torch.cuda.Stream(priority=-1)` makes one. A plain
    torch.Stream, not a subclass: torch.Stream and torch.Event accept only their own types."""
    return torch.Stream(device=on_index(device), priority=priority)


def Event(enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> torch.Event:  # noqa: N802
    return torch.Event(device=on_index(), enable_timing=enable_timing)


def current_stream(device=None) -> torch.Stream:
    return torch.accelerator.current_stream(index_of(device))


default_stream = current_stream


def stream(s: torch.Stream | None):
    """`with torch.fakegpu.stream(s):`; None leaves the current stream, as CUDA's does."""
    return contextlib.nullcontext() if s is None else s


def set_stream(s: torch.Stream) -> None:
    torch.accelerator.set_stream(s)


def synchronize(device=None) -> None:
    """Every op is complete when it returns."""


# -- random numbers: the CPU generator computes them ---------------------------------------------
def manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(seed)  # not torch.manual_seed: that calls manual_seed_all


manual_seed_all = manual_seed


def seed() -> None:
    torch.default_generator.seed()


seed_all = seed


def initial_seed() -> int:
    return torch.default_generator.initial_seed()


def get_rng_state(device=None) -> torch.Tensor:
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device=None) -> None:
    torch.set_rng_state(state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state() for _ in range(device_count())]


def set_rng_state_all(states: list[torch.Tensor]) -> None:
    set_rng_state(states[0])


# -- memory: the ledger --------------------------------------------------------------------------
def memory_allocated(device=None) -> int:
    return LEDGER.allocated[index_of(device)]


def max_memory_allocated(device=None) -> int:
    return LEDGER.peak[index_of(device)]


def reset_peak_memory_stats(device=None) -> None:
    LEDGER.reset_peak(index_of(device))


reset_max_memory_allocated = reset_peak_memory_stats
memory_reserved = memory_allocated  # no caching allocator: what is held is what is allocated
max_memory_reserved = max_memory_allocated


def memory_stats(device=None) -> dict[str, int]:
    index = index_of(device)
    return {
        "allocated_bytes.all.current": LEDGER.allocated[index],
        "allocated_bytes.all.peak": LEDGER.peak[index],
        "reserved_bytes.all.current": LEDGER.allocated[index],
        "reserved_bytes.all.peak": LEDGER.peak[index],
    }


def mem_get_info(device=None) -> tuple[int, int]:
    return TOTAL_MEMORY - memory_allocated(device), TOTAL_MEMORY


def empty_cache() -> None:
    """Nothing is cached."""


def reset_accumulated_memory_stats(device=None) -> None:
    """The ledger keeps no accumulated counts."""


# torch.accelerator's memory functions ask the device's C++ caching allocator, which this device has
# not (an internal assert: "Allocator for fakegpu is not a DeviceAllocator"); they get the ledger's.
_ACCELERATOR_MEMORY = {
    "empty_cache": empty_cache,
    "empty_host_cache": empty_cache,
    "memory_stats": memory_stats,
    "memory_allocated": memory_allocated,
    "max_memory_allocated": max_memory_allocated,
    "memory_reserved": memory_reserved,
    "max_memory_reserved": max_memory_reserved,
    "reset_peak_memory_stats": reset_peak_memory_stats,
    "reset_accumulated_memory_stats": reset_accumulated_memory_stats,
    "get_memory_info": mem_get_info,
}


def answer_accelerator_memory() -> None:
    for module in (torch.accelerator, torch.accelerator.memory):
        for name, function in _ACCELERATOR_MEMORY.items():
            if hasattr(module, name):
                setattr(module, name, function)
