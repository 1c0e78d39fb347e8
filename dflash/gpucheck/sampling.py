"""Once a second while a verb runs: each process's memory and each GPU's utilisation and power
(``nvidia-smi``), and what the JSON says of them; figures a CPU run cannot know are null with a reason."""

from __future__ import annotations

import contextlib
import subprocess
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.gpucheck.figures import rank_pids, read_records


@dataclass
class Sampler:
    """Once a second while a verb runs: each process's memory (GPU per process where nvidia-smi
    reports it, else resident size) and each GPU's utilisation and power."""

    gpus: int
    stop: threading.Event = field(default_factory=threading.Event)
    gpu_samples: list[dict[str, float]] = field(default_factory=list)
    rss: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    gpu_mem: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    _thread: threading.Thread | None = None

    def start(self, root_pid: int) -> Sampler:
        self._thread = threading.Thread(target=self._run, args=(root_pid,), daemon=True)
        self._thread.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    def _run(self, root_pid: int) -> None:
        import psutil

        while not self.stop.is_set():
            try:
                procs = psutil.Process(root_pid).children(recursive=True)
            except psutil.Error:
                procs = []
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    self.rss[p.pid] = max(self.rss[p.pid], p.memory_info().rss)
            if self.gpus:
                self._nvidia_smi()
            self.stop.wait(1.0)

    def _nvidia_smi(self) -> None:
        def query(*args: str) -> str:
            return subprocess.run(["nvidia-smi", *args, "--format=csv,noheader,nounits"], capture_output=True,
                                  text=True, timeout=10).stdout

        try:
            self.gpu_samples += parse_gpu_csv(query("--query-gpu=index,utilization.gpu,power.draw,memory.used"))
            for pid, used in parse_apps_csv(query("--query-compute-apps=pid,used_memory")).items():
                self.gpu_mem[pid] = max(self.gpu_mem[pid], used)
        except (OSError, subprocess.TimeoutExpired):
            pass


def parse_gpu_csv(text: str) -> list[dict[str, Any]]:
    """``nvidia-smi --query-gpu=index,utilization.gpu,power.draw,memory.used --format=csv,noheader,nounits``
    -> one sample per GPU; a value nvidia-smi cannot read (``[N/A]``) is None."""
    out = []
    for line in text.strip().splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 4 and parts[0].isdigit():
            out.append({"gpu": int(parts[0]), "util": _num(parts[1]), "power_w": _num(parts[2]),
                        "used_mib": _num(parts[3])})
    return out


def parse_apps_csv(text: str) -> dict[int, int]:
    """``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`` -> bytes per pid
    (lines without a readable number are left out)."""
    out: dict[int, int] = {}
    for line in text.strip().splitlines():
        parts = [x.strip() for x in line.split(",")]
        used = _num(parts[1]) if len(parts) == 2 and parts[0].isdigit() else None
        if used is not None:
            out[int(parts[0])] = max(out.get(int(parts[0]), 0), int(used * 2**20))
    return out


def _num(x: str) -> float | None:
    try:
        return float(x)
    except ValueError:
        return None


def nvml_summary(sampler: Sampler, gpus: int, run: Path) -> dict[str, Any]:
    if not gpus:
        return {"utilisation_pct_mean": None, "utilisation_pct_max": None, "power_w_mean": None, "power_w_max": None,
                "per_gpu": None, "reason": "no GPU (--cpu): NVML has nothing to report"}
    per: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for s in sampler.gpu_samples:
        per[s["gpu"]].append(s)

    def agg(xs: list[float | None], f: Any) -> float | None:
        vals = [x for x in xs if x is not None]
        return f(vals) if vals else None

    def mean(v: list[float]) -> float:
        return sum(v) / len(v)

    out: dict[str, Any] = {"per_gpu": {}}
    for g, ss in sorted(per.items()):
        out["per_gpu"][str(g)] = {"utilisation_pct_mean": agg([s["util"] for s in ss], mean),
                                  "utilisation_pct_max": agg([s["util"] for s in ss], max),
                                  "power_w_mean": agg([s["power_w"] for s in ss], mean),
                                  "power_w_max": agg([s["power_w"] for s in ss], max),
                                  "memory_used_mib_max": agg([s["used_mib"] for s in ss], max)}
    every = sampler.gpu_samples
    out.update(utilisation_pct_mean=agg([s["util"] for s in every], mean),
               utilisation_pct_max=agg([s["util"] for s in every], max),
               power_w_mean=agg([s["power_w"] for s in every], mean),
               power_w_max=agg([s["power_w"] for s in every], max),
               source="nvidia-smi once a second during the first training run")
    tele = [r.get("telemetry") for r in read_records(run, "step") if r.get("telemetry")]
    if tele:
        out["from_records"] = tele[-1]  # the ranks' own NVML sampling, where the trainer writes it
    if not every:
        out["reason"] = "nvidia-smi gave no samples"
    return out


def gpu_info(gpus: int) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"name": None, "count": gpus, "driver": None, "torch": torch.__version__,
                            "cuda": torch.version.cuda}
    if not gpus:
        info["reason"] = "no GPU (--cpu)"
        return info
    info["name"] = torch.cuda.get_device_name(0)
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip().splitlines()
        info["driver"] = out[0] if out else None
    except (OSError, subprocess.TimeoutExpired):
        info["reason"] = "nvidia-smi not found: driver unknown"
    return info


def peak_memory(run: Path, sampler: Sampler, on_gpu: bool) -> dict[str, Any]:
    """Per rank: the peak the run recorded itself where it does (a ``peak_memory_bytes`` field of the
    summary, by rank), else what this script sampled (GPU memory per process, else resident size)."""
    summary = (read_records(run, "summary") or [{}])[-1]
    recorded = summary.get("peak_memory_bytes")
    out: dict[str, Any] = {}
    for pid, (rank, role) in sorted(rank_pids(run).items(), key=lambda kv: kv[1][0]):
        own = recorded.get(str(rank)) if isinstance(recorded, dict) else None
        dev = sampler.gpu_mem.get(pid) if on_gpu else None
        value = own if own is not None else dev if dev else sampler.rss.get(pid)
        source = ("run records" if own is not None else "nvidia-smi per process" if dev
                  else "resident size (sampled 1/s)")
        out[str(rank)] = {"role": role, "pid": pid, "bytes": value, "source": source,
                          "host_rss_bytes": sampler.rss.get(pid)}
    return out
