"""Device memory, counted: what `torch.fakegpu.memory_allocated` reports.

A device tensor's values live in a CPU tensor, so the process's memory cannot say what the device
holds. The ledger counts each CPU storage behind a device tensor once, while any device tensor over
it lives: views add nothing, a storage freed or resized in place (FSDP2's unsharded parameters)
is re-counted at its new size. Host memory stays apart, so CPU offload shows up as device memory
that is no longer there, as on a GPU.
"""

from __future__ import annotations

import threading
from collections import Counter

import torch


class Ledger:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # autograd's device threads make tensors too
        self._storages: dict[int, list] = {}  # storage key -> [device index, bytes, holders]
        self.allocated: Counter[int] = Counter()
        self.peak: Counter[int] = Counter()

    def hold(self, storage: torch.UntypedStorage, index: int) -> Hold:
        """Count `storage` (once) on device `index` while the returned handle lives (a device tensor
        keeps it in its __dict__) or until it is released (when the tensor is pointed elsewhere)."""
        key = storage._cdata
        with self._lock:
            entry = self._storages.get(key)
            if entry is None:
                self._storages[key] = [index, 0, 1]
                self._set_bytes(key, storage.nbytes())
            else:
                entry[2] += 1
        return Hold(self, key)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """`storage` was resized in place: count its new size."""
        with self._lock:
            if storage._cdata in self._storages:
                self._set_bytes(storage._cdata, storage.nbytes())

    def reset_peak(self, index: int) -> None:
        with self._lock:
            self.peak[index] = self.allocated[index]

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._storages[key]
            entry[2] -= 1
            if entry[2] == 0:
                self._set_bytes(key, 0)
                del self._storages[key]

    def _set_bytes(self, key: int, nbytes: int) -> None:
        entry = self._storages[key]
        index = entry[0]
        self.allocated[index] += nbytes - entry[1]
        entry[1] = nbytes
        self.peak[index] = max(self.peak[index], self.allocated[index])


class Hold:
    """One device tensor's claim on its storage. It lives in the tensor's __dict__ rather than as a
    weakref to the tensor: torch.utils.swap_tensors (Module.to's path for these tensors) refuses a
    tensor with weakrefs, and swaps __dict__s, claims included."""

    __slots__ = ("_ledger", "_key")

    def __init__(self, ledger: Ledger, key: int) -> None:
        self._ledger, self._key = ledger, key

    def holds(self, storage: torch.UntypedStorage) -> bool:
        return self._key == storage._cdata

    def release(self) -> None:
        if self._key is not None:
            self._ledger._release(self._key)
            self._key = None

    __del__ = release


LEDGER = Ledger()
