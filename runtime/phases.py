"""Phase tags: `with phase("policy_update"):` names what the code inside is doing.

The communication profiler stamps every recorded call with `current_phase()`; nested phases join
with "/" ("policy_update/grad_sync"). Each phase is also a torch.profiler range so that traces line
up, and its time is accumulated for the per-step metrics (`take_phase_times`).

On an accelerator the process computes on, a phase's time is the device's: an event on the current
stream where the phase begins and one where it ends (runtime/device_clock.py). The host runs ahead
of the device, so host time would credit the GPU work of one phase to whichever later phase
synchronises. `take_phase_times` waits for the device to reach the last phase's end: one
synchronisation a step, where the step's statistics synchronise anyway. Elsewhere it is host time.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from runtime.device_clock import DeviceClock, Mark

_stack: list[str] = []
_times: dict[str, float] = defaultdict(float)
# device phases that ended, their times still on the device: (name, clock, start, end)
_unresolved: list[tuple[str, DeviceClock, Mark, Mark]] = []
_open: list[tuple[DeviceClock, Mark]] = []  # where the device phases still open began
_clock: DeviceClock | None = None


def current_phase() -> str:
    return "/".join(_stack) if _stack else "none"


def device_clock() -> DeviceClock | None:
    """The clock of the accelerator this process computes on, once it has started using it (a CPU
    stage on a GPU node keeps host time and never initialises CUDA); None when there is none."""
    global _clock
    module = accelerator_in_use()
    if module is None:
        return None
    if _clock is None or _clock.device is not module or _clock.index != module.current_device():
        _clock = DeviceClock(module)  # anew after set_device: events of two devices cannot be compared
    return _clock


def accelerator_in_use():
    if torch.cuda.is_available():
        return torch.cuda if torch.cuda.is_initialized() else None
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return None
    module = torch.get_device_module(accelerator)
    return module if module.is_initialized() else None


@contextmanager
def phase(name: str):
    _stack.append(name)
    full = current_phase()
    clock = device_clock()
    started = clock.mark() if clock is not None else time.perf_counter()
    if clock is not None:
        _open.append((clock, started))
    try:
        with torch.profiler.record_function(f"phase:{full}"):
            yield
    finally:
        if clock is not None:
            _unresolved.append((full, clock, started, clock.mark()))
            _open.pop()
        else:
            _times[full] += time.perf_counter() - started
        _stack.pop()


def take_phase_times() -> dict[str, float]:
    """Seconds spent in each phase since the last call (nested phases counted in their parents too)."""
    for name, clock, started, ended in _unresolved:
        _times[name] += clock.resolve(ended) - clock.resolve(started)
    if _unresolved:
        _clock.forget_before([mark for clock, mark in _open if clock is _clock])
        _unresolved.clear()
    out = dict(_times)
    _times.clear()
    return out
