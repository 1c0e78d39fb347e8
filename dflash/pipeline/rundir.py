"""Every rank sees the one run directory: checked once, together, right after the process group forms.

Why: on several nodes the run directory must be on storage every node sees (docs/ARCHITECTURE.md,
"The run directory"): the coordinator's node writes the records, the ledger and the checkpoints, and
every drafter rank reads the checkpoint on resume. A node that mounted another path (or none) would
otherwise train on, write its rank files into a directory nobody reads, and fail much later, at resume.

How: rank 0 (the first rank, which prepared the directory before the ranks started) writes a fresh
token into ``RUN/.ranks/``; it broadcasts the token; every rank reads the file from its own view of
the path; the ranks gather their verdicts, and if any rank did not see the token every rank fails
with a ConfigError (one line, exit 2): the rank that cannot see it names the path and its node, the
others name that node and its ranks; they leave together, after each has said its line. Nothing is
created on a node that cannot see the directory.
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import torch.distributed as dist

from dflash.core.errors import JointConfigError

TOKEN = "job-token"  # in RUN/.ranks/: rank 0's token of this start


def may_create(out: Path, local_world_size: int, world_size: int) -> bool:
    """Whether this rank may create the run directory itself: only where every rank is on one node (a
    library caller's run, or dflash's own launcher); on several nodes rank 0's CLI prepared it."""
    return local_world_size == world_size or out.is_dir()


def check_visible(out: Path, rank: int, node: int) -> None:
    """Collective: fail (ConfigError, on every rank) unless every rank sees rank 0's run directory."""
    box: list[str | None] = [None]
    if rank == 0:
        box[0] = uuid.uuid4().hex
        tmp = out / ".ranks" / f"{TOKEN}.tmp"
        tmp.write_text(box[0])
        os.replace(tmp, out / ".ranks" / TOKEN)
    dist.broadcast_object_list(box, src=0)
    try:
        seen = (out / ".ranks" / TOKEN).read_text() == box[0]
    except OSError:
        seen = False
    verdicts: list[tuple[int, int, bool] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, (rank, node, seen))
    blind = sorted((r, n) for r, n, ok in verdicts if not ok)  # type: ignore[misc]
    if not blind:
        return
    host = socket.gethostname()
    if not seen:
        what = "does not exist" if not out.is_dir() else "is not the directory rank 0 prepared"
        raise JointConfigError("--out", f"the run directory {out} {what} on node {node} (host {host}); every node must "
                          "see the one run directory (shared storage, the same path)", show_got=False)
    nodes = sorted({n for _, n in blind})
    ranks = ", ".join(str(r) for r, _ in blind)
    raise JointConfigError("--out", f"the run directory {out} is not visible on node(s) {', '.join(map(str, nodes))} "
                      f"(ranks {ranks}); every node must see the one run directory (shared storage, the same path)",
                      show_got=False)


__all__ = ["TOKEN", "check_visible", "may_create"]
