"""Phase tags: `with phase("policy_update"):` names what the code inside is doing.

The communication profiler stamps every recorded call with `current_phase()`; nested phases join
with "/" ("policy_update/grad_sync"). Each phase is also a torch.profiler range so that traces line
up, and its wall time is accumulated for the per-step metrics (`take_phase_times`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

_stack: list[str] = []
_times: dict[str, float] = defaultdict(float)


def current_phase() -> str:
    return "/".join(_stack) if _stack else "none"


@contextmanager
def phase(name: str):
    _stack.append(name)
    full = current_phase()
    started = time.perf_counter()
    try:
        with torch.profiler.record_function(f"phase:{full}"):
            yield
    finally:
        _times[full] += time.perf_counter() - started
        _stack.pop()


def take_phase_times() -> dict[str, float]:
    """Seconds spent in each phase since the last call (nested phases counted in their parents too)."""
    out = dict(_times)
    _times.clear()
    return out
