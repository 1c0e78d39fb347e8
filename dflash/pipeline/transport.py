"""The data plane: an item's tensors move producer -> drafter point-to-point in globally numbered rounds.

Each rank runs its part of round ``r`` (all of an item's tensors, one ``batch_isend_irecv``) in
increasing ``r``; the coordinator numbers the rounds, so crossed producer/drafter pairs cannot
deadlock. Shapes and dtypes come in the control message (``meta``), so the receiver allocates
before the sender's tensors arrive. A producer's tensors are untouched until its send completes.

Three kinds, one interface (:class:`Transport`): ``gloo`` (CPU tensors, every CPU run), ``nccl``
(device to device, one GPU per rank) and ``host`` (one GPU shared by the node's ranks: NCCL refuses
two ranks on one device, so the tensors are staged through host memory and go over gloo).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dflash.pipeline.roles import DATA_GLOO, DATA_HOST, DATA_NCCL

POOL_BUFFERS = 4  # receive buffers kept for reuse
ALIGN = 64  # byte alignment of each tensor inside a receive buffer
DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool)}


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What the receiver needs to allocate one tensor, and a fingerprint to check what arrived."""

    shape: tuple[int, ...]
    dtype: str


def describe(tensors: tuple[torch.Tensor, ...]) -> tuple[TensorMeta, ...]:
    return tuple(TensorMeta(tuple(t.shape), str(t.dtype)) for t in tensors)


def fingerprint(tensors: tuple[torch.Tensor, ...]) -> str:
    """A content hash (sha1 of the bytes) the receiver recomputes: a swapped or damaged transfer fails."""
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def nbytes(metas: tuple[TensorMeta, ...]) -> int:
    return sum(torch.Size(m.shape).numel() * DTYPES[m.dtype].itemsize for m in metas)


@dataclass
class PendingSend:
    """A posted send: its works and the tensors they read (kept alive until the send completes)."""

    works: list[Any]
    tensors: tuple[torch.Tensor, ...]
    t0: float

    def wait(self) -> float:
        for w in self.works:
            w.wait()
        self.tensors = ()
        return time.perf_counter() - self.t0


class Transport:
    """Send / receive one item's tensors in round ``r`` with its peer."""

    kind: str

    def __init__(self, device: torch.device, group: Any = None) -> None:
        self.device = device
        self.group = group
        self.wire = torch.device("cpu") if self.kind in (DATA_GLOO, DATA_HOST) else device
        self._free: list[torch.Tensor] = []  # receive buffers handed back, reused by size
        self._lent: dict[int, torch.Tensor] = {}  # id of a receive's first view -> its buffer

    def post_send(self, tensors: tuple[torch.Tensor, ...], dst: int, rnd: int) -> PendingSend:
        """Post this rank's part of round ``rnd`` (returns at once); the tensors live until ``wait`` returns."""
        t0 = time.perf_counter()
        wire = tuple(t.to(self.wire).contiguous() for t in tensors)
        ops = [dist.P2POp(dist.isend, t, dst, group=self.group, tag=rnd % (1 << 30)) for t in wire]
        return PendingSend(dist.batch_isend_irecv(ops), wire, t0)

    def send(self, tensors: tuple[torch.Tensor, ...], dst: int, rnd: int) -> float:
        """Blocking send of round ``rnd``; returns seconds spent."""
        return self.post_send(tensors, dst, rnd).wait()

    def recv(self, metas: tuple[TensorMeta, ...], src: int, rnd: int) -> tuple[tuple[torch.Tensor, ...], float]:
        """Blocking receive of round ``rnd`` on this rank's device; returns the tensors and seconds.

        The tensors are views of one buffer; hand them back with :meth:`release` when done (the next
        receive reuses the buffer instead of faulting in fresh pages, which costs as much as the copy).
        """
        t0 = time.perf_counter()
        bufs = self._views(metas)
        ops = [dist.P2POp(dist.irecv, b, src, group=self.group, tag=rnd % (1 << 30)) for b in bufs]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        out = tuple(b.to(self.device, non_blocking=False) for b in bufs)
        return out, time.perf_counter() - t0

    def release(self, tensors: tuple[torch.Tensor, ...]) -> None:
        """The caller no longer uses these received tensors: their buffer may be reused."""
        flat = self._lent.pop(id(tensors[0]), None) if tensors else None
        if flat is not None and len(self._free) < POOL_BUFFERS:
            self._free.append(flat)

    def _views(self, metas: tuple[TensorMeta, ...]) -> tuple[torch.Tensor, ...]:
        sizes = [torch.Size(m.shape).numel() * DTYPES[m.dtype].itemsize for m in metas]
        offsets, total = [], 0
        for size in sizes:
            offsets.append(total)
            total += -(-size // ALIGN) * ALIGN
        flat = next((b for b in self._free if b.numel() >= total), None)
        if flat is None:
            flat = torch.empty(max(total, 1), dtype=torch.uint8, device=self.wire)
        else:
            self._free.remove(flat)
        views = tuple(flat[o:o + n].view(DTYPES[m.dtype]).view(m.shape)
                      for o, n, m in zip(offsets, sizes, metas, strict=True))
        if views:
            self._lent[id(views[0])] = flat
            while len(self._lent) > POOL_BUFFERS:  # never released: forget the oldest (it is simply freed)
                self._lent.pop(next(iter(self._lent)))
        return views


class GlooTransport(Transport):
    kind = DATA_GLOO


class NcclTransport(Transport):
    kind = DATA_NCCL


class HostStagedTransport(Transport):
    kind = DATA_HOST


TRANSPORTS: dict[str, type[Transport]] = {t.kind: t for t in (GlooTransport, NcclTransport, HostStagedTransport)}


def make_transport(kind: str, device: torch.device, group: Any = None) -> Transport:
    return TRANSPORTS[kind](device, group)
