"""Device times as wall-clock seconds (float64) whose precision does not degrade over a long stage.

A device event's time is known only relative to another event: `elapsed_time`, in float32
milliseconds (cudaEventElapsedTime; about 0.5 us resolution). Measured from one event taken at the
start, the float32 step grows with the stage: 0.25 ms after an hour, 8 ms after a day. So the clock
re-anchors: at most every `reanchor_every_s` of host time it records an anchor event on a stream of
its own (idle, so the device reaches the event as soon as it is issued), waits for that one event
alone and pairs it with the host clock read around it. A mark (an event recorded on the caller's
stream) is resolved against the anchor nearest to it on the device, so every `elapsed_time` spans
about `reanchor_every_s` (float32 step ~0.1 us at 1 s) and the error does not grow with the stage.
Anchors are paired with the host independently, never chained, so their errors do not add up.

The device module is `torch.cuda` or any with the same Event / Stream / stream /
current_device calls (torch.get_device_module(...)); tests drive a simulated one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

REANCHOR_EVERY_S = 1.0


def wall_clock() -> float:
    return time.time()  # looked up at each call, so that a test's simulated clock stands in


@dataclass
class Anchor:
    index: int
    wall: float  # host wall-clock seconds at which the device reached `event`
    event: object


@dataclass
class Mark:
    """A point on a device stream, turned into wall-clock seconds by `DeviceClock.resolve`."""

    event: object
    anchor: int  # index of the last anchor taken before the mark was recorded


class DeviceClock:
    def __init__(
        self,
        device_module,
        host_now: Callable[[], float] | None = None,
        reanchor_every_s: float = REANCHOR_EVERY_S,
    ):
        if reanchor_every_s <= 0:
            raise ValueError(f"reanchor_every_s must be positive, got {reanchor_every_s}")
        self.device = device_module
        self.index = device_module.current_device()  # events of one device only: elapsed_time needs it
        self.host_now = host_now or wall_clock
        self.reanchor_every_s = reanchor_every_s
        self._stream = device_module.Stream()
        self._anchors: list[Anchor] = []
        self._first = 0  # index of _anchors[0]: anchors no pending mark needs are dropped
        self._anchoring = threading.Lock()  # marks come from the caller's and the backend's threads
        self._anchor(index=0)

    def _anchor(self, index: int) -> None:
        event = self.device.Event(enable_timing=True)
        before = self.host_now()
        with self.device.stream(self._stream):
            event.record()
        event.synchronize()  # this event only: the stream is the clock's own and idle
        after = self.host_now()
        self._anchors.append(Anchor(index, before + (after - before) / 2, event))

    def mark(self) -> Mark:
        """An event at this point of the current stream (re-anchoring first when the last is old)."""
        if self.host_now() - self._anchors[-1].wall >= self.reanchor_every_s:
            with self._anchoring:
                last = self._anchors[-1]
                if self.host_now() - last.wall >= self.reanchor_every_s:
                    self._anchor(last.index + 1)
        event = self.device.Event(enable_timing=True)
        event.record()
        return Mark(event, self._anchors[-1].index)

    def reached(self, mark: Mark) -> bool:
        return mark.event.query()

    def resolve(self, mark: Mark) -> float:
        """The mark's wall-clock seconds (waits for the device to reach it)."""
        mark.event.synchronize()
        at = mark.anchor - self._first
        if at < 0:
            raise ValueError(
                f"mark of anchor {mark.anchor} resolved after anchors before {self._first} were dropped"
            )
        best = self._anchors[at]
        ms = best.event.elapsed_time(mark.event)
        # A deep device queue can put the mark past later anchors: the nearest one gives the shortest span.
        for later in self._anchors[at + 1 :]:
            later_ms = later.event.elapsed_time(mark.event)
            if abs(later_ms) >= abs(ms):
                break
            best, ms = later, later_ms
        return best.wall + ms / 1e3

    def forget_before(self, marks: list[Mark]) -> None:
        """Drop the anchors older than every mark still to be resolved (the newest is always kept)."""
        keep_from = min((m.anchor for m in marks), default=self._anchors[-1].index)
        drop = min(keep_from, self._anchors[-1].index) - self._first
        if drop > 0:
            del self._anchors[:drop]
            self._first += drop
