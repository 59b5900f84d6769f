"""A GPU on a simulated clock, shaped as `torch.cuda` (Event, Stream, stream, synchronize,
current_device), so that tests can run a day of device time in a moment and know every event's
true time.

Time is integer nanoseconds, the same on host and device. Work queues on a stream and runs after
what is ahead of it: the host returns from `launch` at once, and an event recorded on a busy stream
is reached when the stream's work before it is done. `elapsed_time` answers as
cudaEventElapsedTime does: float32 milliseconds.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

NS = 1_000_000_000


class SimulatedGpu:
    def __init__(self, wall_start_s: int = 1_800_000_000):
        self.host_ns = wall_start_s * NS
        self.streams: list = []
        gpu = self

        class Stream:
            def __init__(self, *args, **kwargs):
                self.busy_until_ns = 0
                gpu.streams.append(self)

        class Event:
            def __init__(self, enable_timing: bool = False, **kwargs):
                self.at_ns: int | None = None

            def record(self, stream=None):
                stream = stream or gpu.current
                self.at_ns = max(gpu.host_ns, stream.busy_until_ns)
                stream.busy_until_ns = self.at_ns

            def query(self) -> bool:
                return self.at_ns <= gpu.host_ns

            def synchronize(self) -> None:
                gpu.host_ns = max(gpu.host_ns, self.at_ns)

            def elapsed_time(self, end) -> float:
                return float(np.float32((end.at_ns - self.at_ns) / 1e6))

        self.Stream, self.Event = Stream, Event
        self.current = self.default = Stream()

    # torch.cuda's calls
    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    @contextmanager
    def stream(self, stream):
        outer, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = outer

    def synchronize(self) -> None:
        self.host_ns = max([self.host_ns, *(s.busy_until_ns for s in self.streams)])

    # the simulation
    def time(self) -> float:
        """The host's wall clock (time.time)."""
        return self.host_ns / NS

    def advance(self, seconds: float) -> None:
        """The host works (or idles) for `seconds`."""
        self.host_ns += round(seconds * NS)

    def launch(self, seconds: float) -> None:
        """A kernel of `seconds` on the current stream; the host goes on at once."""
        self.current.busy_until_ns = max(self.host_ns, self.current.busy_until_ns) + round(seconds * NS)

    def install(self, monkeypatch, cuda_module) -> None:
        """Stand in for `cuda_module` (torch.cuda) and the host's time.time for the test's duration."""
        import time

        for name in (
            "is_available",
            "is_initialized",
            "current_device",
            "Event",
            "Stream",
            "stream",
            "synchronize",
        ):
            monkeypatch.setattr(cuda_module, name, getattr(self, name))
        monkeypatch.setattr(time, "time", self.time)
