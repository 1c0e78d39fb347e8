"""The per-pair data plane at run time: the places gathered once, sharing probed per node, one transport.

:func:`settle` is a collective every rank calls once after the process group forms; it returns the
table of :mod:`dflash.pipeline.planes`. :class:`PairedTransport` is the one transport a rank's loops
see: each send or receive goes to the transport of that pair's plane, and a lease goes back to the
transport that made it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dflash.pipeline.planes import PlaneMap, plan, this_place
from dflash.pipeline.roles import FALLBACK, Roles
from dflash.pipeline.transport import Lease, PendingSend, TensorMeta, Transport, make_transport, probe_sharing


def settle(roles: Roles, within: str, device: torch.device) -> PlaneMap:
    """Collective (every rank calls it once, after the process group): gather the places, probe sharing
    within each node where a pair needs it, and return the table."""
    gathered: list[Any] = [None] * roles.world_size
    dist.all_gather_object(gathered, this_place(roles))
    places = tuple(sorted(gathered, key=lambda p: p.rank))
    planned = plan(places, roles, within)
    refused = None
    if within in FALLBACK and any(planned.planes[pair] == within for pair in planned.planes):
        here = places[roles.rank].node
        refused = probe_sharing(within, device, frozenset(p.rank for p in places if p.node == here))
    return plan(places, roles, within, refused) if refused else planned


class PairedTransport(Transport):
    """A rank's one transport: each send or receive goes through its pair's plane (:class:`PlaneMap`)."""

    kind = "per-pair"

    def __init__(self, planes: PlaneMap, rank: int, device: torch.device) -> None:
        super().__init__(device)
        self.planes, self.rank = planes, rank
        kinds = {plane for pair, plane in planes.planes.items() if rank in pair}
        self._by_kind = {k: make_transport(k, device) for k in kinds}
        self._leases: dict[Lease, Transport] = {}  # a lease goes back to the transport that made it (by identity)

    @property
    def wire(self) -> torch.device:
        return self.device

    def _for(self, peer: int) -> Transport:
        return self._by_kind[self.planes.plane(self.rank, peer)]

    def post_send(self, tensors: tuple[torch.Tensor, ...], dst: int, rnd: int) -> PendingSend:
        return self._for(dst).post_send(tensors, dst, rnd)

    def recv(self, metas: tuple[TensorMeta, ...], src: int, rnd: int) -> tuple[Lease, float]:
        transport = self._for(src)
        lease, seconds = transport.recv(metas, src, rnd)
        self._leases[lease] = transport
        return lease, seconds

    def release(self, lease: Lease, settled: bool = False) -> None:
        transport = self._leases.pop(lease, None)
        if transport is None:
            raise RuntimeError("a received item was released twice (or was not received here)")
        transport.release(lease, settled)


__all__ = ["PairedTransport", "settle"]
