"""Host syncs on the drafter's hot path, made few and countable (issue 34 item 2).

Why: every ``.item()``, ``.tolist()``, ``int(tensor)`` or boolean-mask index of a device tensor makes
the host wait until the device has drained its queue, so the host cannot queue the next kernels while
the device works; at ~30 ms drafter steps a dozen such waits cost 5-10%. The hot path therefore reads
device values only through :func:`to_host` (one call per step: the stats all-reduce), and everything
the host must know to *plan* a step (anchor positions, counted slots, token and weight counts) comes
from :class:`HostMasks`, the item's masks as the producer's host saw them, sent in the item's metadata.

Counting: :func:`to_host` and :func:`note_sync` add to a process-wide counter, whatever the device, so
a CPU test sees how many waits the same code would make on a GPU (:func:`counting`). Where CUDA is
present, ``torch.cuda.set_sync_debug_mode`` checks the same thing on the device itself.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

_lock = threading.Lock()
_count = 0
_where: deque[str] = deque(maxlen=256)  # the latest sync points, for a test's message


def note_sync(where: str) -> None:
    """Count one host wait on the device (called by every sync point the hot path keeps)."""
    global _count
    with _lock:
        _count += 1
        _where.append(where)


def total() -> int:
    """Host syncs counted in this process so far."""
    return _count


def to_host(t: torch.Tensor, where: str = "to_host") -> list[Any]:
    """``t.tolist()``, counted as one host sync (free on the CPU, a wait for the device on a GPU)."""
    note_sync(where)
    return t.tolist()


@dataclass
class SyncCount:
    """Host syncs counted inside one :func:`counting` block, and where the latest happened."""

    n: int = 0
    where: tuple[str, ...] = ()


@contextmanager
def counting() -> Iterator[SyncCount]:
    """Counts the syncs made inside the block (all threads of the process)."""
    start = total()
    out = SyncCount()
    try:
        yield out
    finally:
        with _lock:
            out.n = _count - start
            out.where = tuple(_where)[-min(out.n, len(_where)):] if out.n else ()


@dataclass(frozen=True, slots=True)
class HostMasks:
    """An item's attention and loss masks as runs of ones per row, known to the host without a device read.

    ``real[r]`` and ``loss[r]`` are the ``(start, end)`` spans of ones in row ``r`` of the attention and
    loss masks; ``width`` is the padded length. A few spans per row (one per response turn), so they
    travel in the item's control message for a few bytes.
    """

    width: int
    real: tuple[tuple[tuple[int, int], ...], ...]
    loss: tuple[tuple[tuple[int, int], ...], ...]

    @classmethod
    def of(cls, attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> HostMasks:
        """From masks on any device (one device read on the producer, off the drafter's path)."""
        am, lm = attention_mask.detach().to("cpu").bool(), loss_mask.detach().to("cpu").bool()
        return cls(int(lm.shape[1]), spans(am), spans(lm))

    @property
    def lengths(self) -> torch.Tensor:
        """Real tokens per row (``attention_mask.sum(1)``)."""
        return torch.tensor([sum(e - s for s, e in row) for row in self.real], dtype=torch.long)

    def attention_mask(self) -> torch.Tensor:
        return _dense(self.real, self.width)

    def loss_mask(self) -> torch.Tensor:
        return _dense(self.loss, self.width)


def spans(mask: torch.Tensor) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Runs of True per row of a 2-D bool CPU tensor, as ``(start, end)`` pairs."""
    out = []
    padded = torch.nn.functional.pad(mask.to(torch.int8), (1, 1))
    for row in padded:
        edges = torch.nonzero(row[1:] != row[:-1]).flatten().tolist()
        out.append(tuple((edges[i], edges[i + 1]) for i in range(0, len(edges), 2)))
    return tuple(out)


def _dense(rows: tuple[tuple[tuple[int, int], ...], ...], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.bool)
    for r, row in enumerate(rows):
        for s, e in row:
            out[r, s:e] = True
    return out


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a host wait: pinned and ``non_blocking`` where CUDA is the target
    (a pageable copy synchronises the stream); unchanged on the CPU."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


__all__ = ["HostMasks", "SyncCount", "counting", "note_sync", "spans", "to_device", "to_host", "total"]
