"""Builds and loads guard.cpp, the emulated device's C++ device guard (guard.cpp says why it is C++).

The library is compiled once per torch version and source (PyTorch's extension cache, under
TORCH_EXTENSIONS_DIR when set; about 2 s) and must be loaded before the device is registered:
PyTorch keeps the first guard registered for PrivateUse1.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from torch.utils import cpp_extension

SOURCE = Path(__file__).with_name("guard.cpp")


def load_guard(device_count: int) -> None:
    path = cpp_extension.load(name="hpcr1_fakegpu_guard", sources=[str(SOURCE)], is_python_module=False)
    ctypes.CDLL(path).hpcr1_fakegpu_set_device_count(device_count)
