"""Several nodes through dflash's own launcher: ``dflash train --nnodes N --node-rank R --rdzv-endpoint HOST:PORT``.

Why: under torchrun, torchrun parses ``--nnodes`` and a missing rendezvous endpoint never reaches
dflash (the agent waits for its peers before any rank starts). With dflash's own launcher the flags are
dflash's, so they are checked here, before anything starts, one line and exit 2 each.

How: a *static* rendezvous (torch's own, as ``torchrun --rdzv-backend static``): node R is group rank R,
so the node numbers are the user's, and node 0, which listens at the endpoint, is the one that prepares
the run directory (the others only check that they see it, dflash.pipeline.rundir). Every node gives
the same ``--nnodes``, ``--rdzv-endpoint``, ``--nproc-per-node`` and ``--out`` (or ``--resume``).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.core.errors import ConfigError

RUN_ID = "dflash-nodes"  # the static rendezvous's store prefix: the same on every node


@dataclass(frozen=True)
class Nodes:
    """This node's place in a job of ``count`` nodes (one node: ``Nodes()``)."""

    count: int = 1
    rank: int = 0
    endpoint: str | None = None

    @classmethod
    def from_flags(cls, nnodes: int | None, node_rank: int | None, endpoint: str | None, *,
                   under_launcher: bool) -> Nodes:
        """The flags, checked: ConfigError (one line naming the flag) for any combination that cannot start."""
        given = [f for f, v in (("--nnodes", nnodes), ("--node-rank", node_rank), ("--rdzv-endpoint", endpoint))
                 if v is not None]
        if under_launcher and given:
            raise ConfigError(given[0], "is the launcher's own flag: under torchrun give --nnodes, --node-rank and "
                              "--rdzv-endpoint to torchrun", show_got=False)
        count = nnodes or 1
        if count == 1:
            if node_rank not in (None, 0) or endpoint is not None:
                raise ConfigError(given[-1], "is only for several nodes (--nnodes above 1)", show_got=False)
            return cls()
        if endpoint is None:
            raise ConfigError("--nnodes", f"above 1 needs --rdzv-endpoint HOST:PORT (where node 0 listens; every "
                              f"node gives the same), got --nnodes {count} without it", show_got=False)
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError("--rdzv-endpoint", "must be HOST:PORT with a port of 1 .. 65535", endpoint)
        if node_rank is None:
            raise ConfigError("--node-rank", f"must be given with --nnodes {count}: 0 .. {count - 1} (node 0 prepares "
                              "the run directory)", show_got=False)
        if node_rank >= count:
            raise ConfigError("--node-rank", f"must be below --nnodes ({count})", node_rank)
        return cls(count, node_rank, endpoint)

    @property
    def several(self) -> bool:
        return self.count > 1

    def own_ranks(self, local: int) -> range:
        """The global ranks this node starts (torch numbers ranks node by node)."""
        return range(self.rank * local, (self.rank + 1) * local)


__all__ = ["RUN_ID", "Nodes"]
