"""A rank's host memory around its training loop, for checking the memory model against measurement.

Why here: the memory model (:mod:`dflash.core.memory_model`) predicts what a rank allocates once it
trains; the honest measurement is the kernel's own peak resident size (``VmHWM``) of the rank process
after the loop minus the same figure just before the first step (what loading left behind is not the
loop's). A drafter rank also records ``VmHWM`` after each step (:meth:`HostMemory.each_step`): its
figure is the peak over its steps, without what the run's end does once (the final checkpoint, the
records' Parquet export, which imports pyarrow: ~50 MiB of a small job's drafter rank, measured). Each
rank writes ``RUN/.ranks/rank-N.memory.json`` with these and its resident size then (``VmRSS``);
``benchmarks/rank_memory.py`` reads them. Linux only (``/proc/self/status``); elsewhere
nothing is written. GPU memory is not here: ``torch.cuda.max_memory_allocated`` is the GPU's figure.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, TypeVar

T = TypeVar("T")


STATUS_KEYS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")  # peak, resident, and resident by kind


def status_bytes() -> dict[str, int]:
    """``VmHWM``, ``VmRSS`` and the resident size by kind (anonymous, file pages, shared memory) of this
    process in bytes (empty where /proc is missing)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in STATUS_KEYS:
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        return {}
    return out


class HostMemory:
    """``before()`` just before the first step, ``each_step`` around the step, ``after()`` once the loop is
    done; writes the JSON. ``loop_peak_bytes``: the peak over the steps where steps were recorded, else
    over the whole loop; ``run_peak_bytes``: over the whole loop, its end included."""

    def __init__(self, ranks_dir: Path, rank: int, role: str) -> None:
        self.path = ranks_dir / f"rank-{rank}.memory.json"
        self.record: dict[str, Any] = {"rank": rank, "role": role, "pid": os.getpid()}
        self.step_hwm: list[int] = []

    def before(self) -> None:
        self.record["before_first_step"] = status_bytes()

    def each_step(self, step: Callable[..., T]) -> Callable[..., T]:
        """``step`` that records the process's ``VmHWM`` once it returns (a read of /proc: ~20 us)."""
        def recorded(*args: Any, **kwargs: Any) -> T:
            out = step(*args, **kwargs)
            hwm = status_bytes().get("VmHWM")
            if hwm is not None:
                self.step_hwm.append(hwm)
            return out
        return recorded

    def after(self) -> None:
        self.record["after_loop"] = status_bytes()
        start, end = self.record.get("before_first_step", {}), self.record["after_loop"]
        if "VmHWM" in start and "VmHWM" in end:
            self.record["run_peak_bytes"] = end["VmHWM"] - start["VmHWM"]
            self.record["step_peak_bytes"] = [h - start["VmHWM"] for h in self.step_hwm]
            self.record["loop_peak_bytes"] = (max(self.step_hwm) if self.step_hwm else end["VmHWM"]) - start["VmHWM"]
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
