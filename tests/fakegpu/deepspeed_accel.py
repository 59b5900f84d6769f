"""DeepSpeed on the emulated device: DeepSpeed allocates its buffers, streams and memory reports
through its accelerator object, which it picks once (CUDA, else the CPU). This one is DeepSpeed's CPU
accelerator (CPU op builders, host timers: the device is synchronous) naming the emulated device,
its collective backend, its streams and its memory ledger."""

from __future__ import annotations

import functools

import torch
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

from tests.fakegpu import device as fakegpu
from tests.fakegpu.ccl import BACKEND
from tests.fakegpu.device import DEVICE_TYPE

# The CPU accelerator's collectives (oneCCL, shared memory), which DeepSpeed would build and set up
# beside the device's backend; a GPU's accelerator has none.
CPU_COMMUNICATION = {"CCLCommBuilder", "ShareMemCommBuilder"}


class FakeGpuAccelerator(CPU_Accelerator):
    def __init__(self):
        super().__init__()
        self._name = DEVICE_TYPE
        self._communication_backend_name = BACKEND

    # -- the device --------------------------------------------------------------------------------
    def device_name(self, device_index=None) -> str:
        return DEVICE_TYPE if device_index is None else f"{DEVICE_TYPE}:{device_index}"

    def current_device_name(self) -> str:
        return self.device_name(self.current_device())

    def current_device(self) -> int:
        return fakegpu.current_device()

    def set_device(self, device_index) -> None:
        fakegpu.set_device(device_index)

    def device(self, device_index=None):
        return fakegpu.device(device_index)

    def device_count(self) -> int:
        return fakegpu.device_count()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == DEVICE_TYPE

    def create_op_builder(self, op_name):
        return None if op_name in CPU_COMMUNICATION else super().create_op_builder(op_name)

    def get_op_builder(self, class_name):
        return None if class_name in CPU_COMMUNICATION else super().get_op_builder(class_name)

    def pin_memory(self, tensor, align_bytes=1):
        return tensor  # no pinned host memory for this device

    # -- tensor types: CUDA's accelerator makes them on its device (cuda_accelerator.py), the CPU's on the
    # CPU, which the device's group refuses (ZeRO-0 bf16's overflow check all-reduces a ByteTensor) ------
    def _typed(self, dtype: torch.dtype):
        return functools.partial(torch.tensor, dtype=dtype, device=self.current_device_name())

    BFloat16Tensor = property(lambda self: self._typed(torch.bfloat16))
    ByteTensor = property(lambda self: self._typed(torch.uint8))
    DoubleTensor = property(lambda self: self._typed(torch.double))
    FloatTensor = property(lambda self: self._typed(torch.float))
    HalfTensor = property(lambda self: self._typed(torch.half))
    IntTensor = property(lambda self: self._typed(torch.int))
    LongTensor = property(lambda self: self._typed(torch.long))

    # -- streams and events ---------------------------------------------------------------------------
    @property
    def Stream(self):
        return fakegpu.Stream

    def stream(self, stream):
        return fakegpu.stream(stream)

    def current_stream(self, device_index=None):
        return fakegpu.current_stream(device_index)

    def default_stream(self, device_index=None):
        return fakegpu.default_stream(device_index)

    @property
    def Event(self):
        return fakegpu.Event

    # -- memory: the ledger ----------------------------------------------------------------------------
    def memory_allocated(self, device_index=None) -> int:
        return fakegpu.memory_allocated(device_index)

    def max_memory_allocated(self, device_index=None) -> int:
        return fakegpu.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index=None) -> None:
        fakegpu.reset_peak_memory_stats(device_index)

    reset_peak_memory_stats = reset_max_memory_allocated
    memory_cached = memory_reserved = memory_allocated
    max_memory_cached = max_memory_reserved = max_memory_allocated
    reset_max_memory_cached = reset_max_memory_allocated

    def memory_stats(self, device_index=None) -> dict:
        return fakegpu.memory_stats(device_index)

    def total_memory(self, device_index=None) -> int:
        return fakegpu.TOTAL_MEMORY

    def available_memory(self, device_index=None) -> int:
        return fakegpu.mem_get_info(device_index)[0]


def install(real_accelerator) -> None:
    """Make DeepSpeed's accelerator (deepspeed.accelerator.real_accelerator) the emulated device's."""
    if not isinstance(real_accelerator.ds_accelerator, FakeGpuAccelerator):
        real_accelerator.set_accelerator(FakeGpuAccelerator())
