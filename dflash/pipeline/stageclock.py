"""Stage timings that mean what they say on a GPU: each stage starts and ends with a device synchronisation.

CUDA kernels run asynchronously, so a host clock around ``forward()`` measures the launch, and the
next stage that waits for the device is charged with the work (the first GPU run's "transfer" and
"optimizer" shares were partly the drafter's backward). Synchronising at both ends puts each stage's
device work inside it. On the CPU the synchronisation is a no-op and the clock is the plain host clock.
The cost on a GPU is the lost overlap between host and device at stage boundaries, a few per step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on this thread's current stream of ``device`` (a no-op off CUDA).

    The current stream only, not the whole device (issue 34): the producer times its forward on its compute
    stream while its sends run on another, and a device-wide wait would also wait for those sends, which
    finish only when the drafter receives."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class StageClock:
    """Adds the seconds of named stages into ``stages`` (a dict the caller reports)."""

    def __init__(self, device: torch.device, stages: dict[str, float] | None = None) -> None:
        self.device = device
        self.stages: dict[str, float] = {} if stages is None else stages

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        synchronize(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.stages[name] = self.stages.get(name, 0.0) + time.perf_counter() - t0
