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
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

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


def mapped_bytes() -> dict[str, int]:
    """Resident bytes by what is mapped (``/proc/self/smaps``): torch's libraries (kernel code, paged in
    the first time a kernel runs), checkpoint files (``*.safetensors``: a float32 CPU load maps them and
    the pages a forward reads become resident), shared memory (the data plane's buffers), the rest
    (heap and anonymous maps). Empty where /proc is missing; ~2 ms."""
    out = {"torch libraries": 0, "checkpoint files": 0, "shared memory": 0, "anonymous": 0, "other files": 0}
    kind = "anonymous"
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head, _, rest = line.partition(" ")
                if head == "Rss:":
                    out[kind] += int(rest.split()[0]) * 1024
                elif "-" in head and not head.endswith(":"):
                    path = line.split(maxsplit=5)[5].strip() if len(line.split(maxsplit=5)) > 5 else ""
                    kind = ("torch libraries" if "/torch/lib/" in path else "checkpoint files"
                            if path.endswith(".safetensors") else "shared memory" if path.startswith("/dev/shm")
                            else "anonymous" if not path.startswith("/") else "other files")
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
        self.record["mapped_before"] = mapped_bytes()

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
        self.record["mapped_after"] = mapped_bytes()
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


MMAP_THRESHOLD_BYTES = 256 * 1024  # glibc: an allocation at least this large is its own map, unmapped when freed
_M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
RETURN_FREED_ENV = "DFLASH_RETURN_FREED_MEMORY"  # =1: fix glibc's mmap threshold (see return_freed_memory)


def return_freed_memory() -> bool:
    """With ``DFLASH_RETURN_FREED_MEMORY=1``, make glibc give a freed tensor's memory back at once (a CPU
    rank, before its first step). True if set.

    Why it exists: by default glibc raises its mmap threshold to the size of each large block freed (up
    to 32 MiB), so later blocks that size come from the heap, which keeps freed memory and fragments: a
    CPU drafter rank's peak resident size then grows step after step, by up to 90 MiB above what its
    tensors ever held at once (benchmarks/rank_memory.py, the "long" shape: 248 MiB after 6 steps against
    166 MiB with the threshold fixed; RESULTS.md). Fixed at 256 KiB, every tensor that size or larger is
    mapped on its own and unmapped when freed, so the resident size follows what the step holds and the
    memory model (which counts tensors) can be held against it: ``benchmarks/rank_memory.py`` sets it.

    Why it is off by default: each step then faults its large blocks in again. Measured CPU seconds per
    drafter step (in-process, loaded machine): +16% on the long shape, +33% on the wide one; per SmolLM2
    target forward of 340 tokens (one thread, ``benchmarks/freed_memory_cost.py``): 1.09x,
    which would slow every CPU job (the demo's budget is counted in target forwards) to bound a peak that
    the pre-flight check compares against the host's whole available memory anyway. glibc only (Linux);
    elsewhere nothing changes."""
    import ctypes
    import ctypes.util

    if os.environ.get(RETURN_FREED_ENV, "") in ("", "0"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False


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


def check_node_fits(cfg: Any, local_world_size: int, *, force: bool = False, node_rank_offset: int = 0) -> None:
    """The pre-flight of every verb that trains (``train``, ``validate``, ``demo``): each device of this node
    holds the roles placed on it, against its own capacity, or ConfigError in one line naming the device,
    the need and the capacity (exit 2); ``force`` (``--force``) is the one way past it."""
    from dflash.core.memory_model import check_fits

    placement = node_placement(cfg, local_world_size, node_rank_offset)
    check_fits(cfg, placement, device_capacity([d for _, d in placement]), force=force)


def device_capacity(devices: list[str]) -> dict[str, float]:
    """Bytes each device holds: CUDA's total memory for a GPU; for the CPU ranks, the host's available
    memory now (``MemAvailable``: what can be allocated without swapping), which they share."""
    import torch

    out: dict[str, float] = {}
    for d in sorted(set(devices)):
        if d.startswith("cuda"):
            out[d] = float(torch.cuda.get_device_properties(int(d.partition(":")[2] or 0)).total_memory)
            out["host"] = float(host_available_bytes())  # GPU ranks' host RAM (memory_model.HOST)
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
