"""Streams, events and stage timers of the hot path, with null stand-ins so the CPU runs the same code.

Why (issue 34 item 1): a device-wide ``torch.cuda.synchronize`` at every stage boundary also waits for
NCCL sends already posted (which finish only when the peer receives), and a send queued on the default
stream waits behind the forward that runs there. So on a GPU:

- the producer's forward runs on its own stream (:attr:`Streams.compute`) and records an event per item;
  its sends run on a side stream (:attr:`Streams.send`) that waits on that event, so the next forward
  never waits for a receive and a send never waits for the next forward;
- stages are timed by CUDA events recorded around them and read when they have completed (the step's
  one host sync completes every event recorded before it; the rest are read a step later), never by a
  synchronize.

On the CPU there are no streams: :class:`NullEvent` records the host clock when recorded and is always
complete, so :class:`StageTimer` gives the host times the CPU has always reported and the bookkeeping
(which stage, which step) is the GPU's, tested in CI.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch


class NullEvent:
    """A CUDA event's interface on the CPU: the host clock at :meth:`record`, complete at once."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t: float | None = None

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return self.t is not None

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def elapsed_time(self, end: NullEvent) -> float:
        """Milliseconds from this event to ``end`` (CUDA's unit)."""
        assert self.t is not None and end.t is not None
        return (end.t - self.t) * 1e3


def new_event(device: torch.device) -> Any:
    """A timing event on ``device`` (a :class:`NullEvent` off CUDA)."""
    if device.type == "cuda":
        return torch.cuda.Event(enable_timing=True)
    return NullEvent()


class Streams:
    """The producer's two streams on its device (None on the CPU: the current, only, stream)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        cuda = device.type == "cuda"
        self.compute = torch.cuda.Stream(device) if cuda else None
        self.send = torch.cuda.Stream(device) if cuda else None

    def on(self, stream: Any) -> Any:
        """A context making ``stream`` current (nothing on the CPU)."""
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def mark(self, stream: Any = None) -> Any:
        """An event recorded now on ``stream`` (default: the compute stream): "the item is computed"."""
        ev = new_event(self.device)
        ev.record(stream if stream is not None else self.compute)
        return ev

    def wait(self, stream: Any, event: Any) -> None:
        """``stream`` waits on the device for ``event`` (the host does not wait)."""
        if stream is not None:
            stream.wait_event(event)

    def keep(self, tensors: tuple[torch.Tensor, ...], stream: Any) -> None:
        """Tell the caching allocator ``tensors`` are used on ``stream`` (made on another one), so their memory
        is not handed out again before that stream's work on them is done."""
        if stream is not None:
            for t in tensors:
                if t.device.type == "cuda":
                    t.record_stream(stream)


class StageTimer:
    """Adds seconds per named stage into a dict, from events read when complete, never by a synchronize.

    ``stage(name)`` records an event at both ends; ``host_stage(name)`` times with the host clock (host work:
    a gloo all-reduce, a blocking receive). :meth:`collect` adds every finished stage, in order, and keeps
    the rest for the next call (a stage whose end event has not run yet is read one step later).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: list[tuple[str, Any, Any]] = []

    def stage(self, name: str) -> AbstractContextManager[None]:
        return self._timed(name, new_event(self.device), new_event(self.device))

    def host_stage(self, name: str) -> AbstractContextManager[None]:
        return self._timed(name, NullEvent(), NullEvent())

    @contextmanager
    def _timed(self, name: str, start: Any, end: Any) -> Iterator[None]:
        """The stage between two events of one kind: device events (read once complete) or host ones."""
        start.record()
        try:
            yield
        finally:
            end.record()
            self._pending.append((name, start, end))

    def add(self, name: str, seconds: float) -> None:
        """A stage timed elsewhere (a receive's own host seconds)."""
        start, end = NullEvent(), NullEvent()
        start.t, end.t = 0.0, seconds
        self._pending.append((name, start, end))

    @property
    def pending(self) -> int:
        return len(self._pending)

    def collect(self, into: dict[str, float]) -> dict[str, float]:
        """Adds the finished stages' seconds into ``into`` (returns it); unfinished ones wait for the next call.

        Stops at the first unfinished stage: events of one stream complete in order, so what follows it is
        unfinished too (and the order of the stages in ``into`` stays the order they ran).
        """
        done = 0
        for name, start, end in self._pending:
            if not end.query():
                break
            into[name] = into.get(name, 0.0) + start.elapsed_time(end) / 1e3
            done += 1
        del self._pending[:done]
        return into


__all__ = ["NullEvent", "StageTimer", "Streams", "new_event"]
