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


class Transport:
    """Send / receive one item's tensors in round ``r`` with its peer."""

    kind: str

    def __init__(self, device: torch.device, group: Any = None) -> None:
        self.device = device
        self.group = group
        self.wire = torch.device("cpu") if self.kind in (DATA_GLOO, DATA_HOST) else device

    def send(self, tensors: tuple[torch.Tensor, ...], dst: int, rnd: int) -> float:
        """Blocking send of round ``rnd``; returns seconds spent."""
        t0 = time.perf_counter()
        wire = tuple(t.to(self.wire).contiguous() for t in tensors)
        ops = [dist.P2POp(dist.isend, t, dst, group=self.group, tag=rnd % (1 << 30)) for t in wire]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return time.perf_counter() - t0

    def recv(self, metas: tuple[TensorMeta, ...], src: int, rnd: int) -> tuple[tuple[torch.Tensor, ...], float]:
        """Blocking receive of round ``rnd`` into fresh tensors on this rank's device; returns them and seconds."""
        t0 = time.perf_counter()
        bufs = tuple(torch.empty(m.shape, dtype=DTYPES[m.dtype], device=self.wire) for m in metas)
        ops = [dist.P2POp(dist.irecv, b, src, group=self.group, tag=rnd % (1 << 30)) for b in bufs]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        out = tuple(b.to(self.device, non_blocking=False) for b in bufs)
        return out, time.perf_counter() - t0


class GlooTransport(Transport):
    kind = DATA_GLOO


class NcclTransport(Transport):
    kind = DATA_NCCL


class HostStagedTransport(Transport):
    kind = DATA_HOST


TRANSPORTS: dict[str, type[Transport]] = {t.kind: t for t in (GlooTransport, NcclTransport, HostStagedTransport)}


def make_transport(kind: str, device: torch.device, group: Any = None) -> Transport:
    return TRANSPORTS[kind](device, group)
