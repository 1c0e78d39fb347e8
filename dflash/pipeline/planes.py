"""One data plane per producer -> drafter pair: sharing within a node, the network across nodes.

Why per pair: a sharing plane (shm, CUDA IPC) maps the producer's buffer in the drafter's process, which
only works where both run on one node; a job on several nodes used to fall back to the copying plane
for *every* pair, so the pairs that do share a node paid a copy they need not. Here each rank learns
every rank's node from the launcher (``GROUP_RANK``, the agent's node rank, gathered once), and each
pair gets:

- within a node: the node's plane (:func:`node_plane`, the sharing plane where the placement has one);
- across nodes: the placement's copying plane (gloo on the CPU, host staging on a shared GPU, NCCL).

The ranks probe sharing together, each mapping only its own node's buffers, and fall back together
(every within-node pair then copies; the line says why). A pair's two ends compute the same table
from the same gathered places, so they always agree.

Torch-free: this module is the table; :mod:`dflash.pipeline.paired` gathers the places, probes, and is
the one transport a rank's loops see. What neither does: choose a plane by measuring, or let a pair
change plane mid-run.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from dflash.pipeline.roles import FALLBACK, Roles, choose_plane, data_plane

NODE_ENV = "GROUP_RANK"  # torchrun's (and torch's elastic launcher's) node rank of this agent


@dataclass(frozen=True, slots=True)
class RankPlace:
    """Where one rank runs: its node (the launcher's node rank), its rank on that node, its host."""

    rank: int
    node: int
    local_rank: int
    host: str


def this_place(roles: Roles) -> RankPlace:
    return RankPlace(roles.rank, int(os.environ.get(NODE_ENV, "0")), roles.local_rank, socket.gethostname())


def node_plane(cuda_devices: int, local_world_size: int, requested: str = "auto") -> str:
    """The plane for pairs within one node (ConfigError for a requested plane the placement refuses)."""
    return choose_plane(data_plane(cuda_devices, local_world_size), one_node=True, requested=requested)


@dataclass(frozen=True)
class PlaneMap:
    """Every rank's place and every producer -> drafter pair's plane, the same table on every rank."""

    places: tuple[RankPlace, ...]  # by rank
    planes: dict[tuple[int, int], str]  # (producer rank, drafter rank) -> plane
    refused: str | None = None  # why sharing within a node was refused (its pairs then copy)

    def plane(self, a: int, b: int) -> str:
        """The plane between ranks ``a`` and ``b`` (either order: one is the producer)."""
        return self.planes[(a, b)] if (a, b) in self.planes else self.planes[(b, a)]

    def crosses(self, producer: int, drafter: int) -> bool:
        return self.places[producer].node != self.places[drafter].node

    def lines(self) -> list[str]:
        """What the run says: one line per plane in use, naming its pairs."""
        by: dict[str, list[str]] = {}
        for (p, d), plane in sorted(self.planes.items()):
            where = "across nodes" if self.crosses(p, d) else f"node {self.places[p].node}"
            by.setdefault(plane, []).append(f"{p}->{d} ({where})")
        out = [f"data plane {plane} for pairs {', '.join(pairs)}" for plane, pairs in by.items()]
        if self.refused:
            out.append(f"sharing within a node was refused ({self.refused}), so its pairs copy")
        return out

    def as_json(self) -> dict[str, Any]:
        """The summary's ``placement``: each rank's node and local rank, each pair's plane."""
        return {"ranks": {str(p.rank): {"node": p.node, "local_rank": p.local_rank, "host": p.host}
                          for p in self.places},
                "pairs": {f"{p}->{d}": plane for (p, d), plane in sorted(self.planes.items())},
                "sharing_refused": self.refused}


def plan(places: tuple[RankPlace, ...], roles: Roles, within: str, refused: str | None = None) -> PlaneMap:
    """The pairs' planes: ``within`` (or its copying fallback, where sharing was refused) for pairs on one
    node, the copying plane for pairs across nodes."""
    copying = FALLBACK.get(within, within)
    same = copying if refused else within
    planes = {(p, d): same if places[p].node == places[d].node else copying
              for p in roles.target_ranks for d in roles.drafter_ranks}
    return PlaneMap(places, planes, refused)


__all__ = ["NODE_ENV", "PlaneMap", "RankPlace", "node_plane", "plan", "this_place"]
