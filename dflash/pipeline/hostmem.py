"""A rank's host memory around its training loop, for checking the memory model against measurement.

Why here: the memory model (:mod:`dflash.core.memory_model`) predicts what a rank allocates once it
trains; the honest measurement is the kernel's own peak resident size (``VmHWM``) of the rank process
after the loop minus the same figure just before the first step (what loading left behind is not the
loop's). Each rank writes ``RUN/.ranks/rank-N.memory.json`` with both and its resident size then
(``VmRSS``); ``benchmarks/rank_memory.py`` reads them. Linux only (``/proc/self/status``); elsewhere
nothing is written. GPU memory is not here: ``torch.cuda.max_memory_allocated`` is the GPU's figure.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def status_bytes() -> dict[str, int]:
    """``VmHWM`` and ``VmRSS`` of this process in bytes (empty where /proc is missing)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmHWM", "VmRSS"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        return {}
    return out


class HostMemory:
    """``before()`` just before the first step, ``after()`` once the loop is done; writes the JSON."""

    def __init__(self, ranks_dir: Path, rank: int, role: str) -> None:
        self.path = ranks_dir / f"rank-{rank}.memory.json"
        self.record: dict[str, Any] = {"rank": rank, "role": role, "pid": os.getpid()}

    def before(self) -> None:
        self.record["before_first_step"] = status_bytes()

    def after(self) -> None:
        self.record["after_loop"] = status_bytes()
        start, end = self.record.get("before_first_step", {}), self.record["after_loop"]
        if "VmHWM" in start and "VmHWM" in end:
            self.record["loop_peak_bytes"] = end["VmHWM"] - start["VmHWM"]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.record))
        except OSError:
            pass  # a figure for checking the model, never a reason to fail the run


def node_placement(cfg: Any, local_world_size: int, node_rank_offset: int = 0) -> list[tuple[str, str]]:
    """(role, device) of each rank this node starts, by the device rule (roles.device_for): the
    memory model sums the roles that share a device (one shared GPU, or the host for CPU ranks)."""
    import torch

    from dflash.pipeline.roles import TARGET, device_for

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    n_t, n_d = cfg.cluster.n_target, cfg.cluster.n_drafter
    out = []
    for local in range(local_world_size):
        rank = node_rank_offset + local
        if rank >= n_t + n_d:
            break
        out.append((TARGET if rank < n_t else "drafter", device_for(local, cuda)))
    return out


def device_capacity(devices: list[str]) -> dict[str, float]:
    """Bytes each device holds: CUDA's total memory for a GPU; for the CPU ranks, the host's available
    memory now (``MemAvailable``: what can be allocated without swapping), which they share."""
    import torch

    out: dict[str, float] = {}
    for d in sorted(set(devices)):
        if d.startswith("cuda"):
            out[d] = float(torch.cuda.get_device_properties(int(d.partition(":")[2] or 0)).total_memory)
        else:
            out[d] = float(host_available_bytes())
    return out


def host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return int(psutil.virtual_memory().available)
