"""The figures the JSON reports, read from a finished run's records (``summary``, ``produce``,
``take`` and ``step`` JSONL) and from the verbs' own outputs."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any


def read_records(run: Path, kind: str) -> list[dict[str, Any]]:
    p = run / f"{kind}.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def stages(run: Path) -> dict[str, Any]:
    """Mean seconds per step of each stage: the drafter side from the summary's ``stage_means_s``
    (the trainer's stage timers), the target forward from the produce records (per item)."""
    summary = (read_records(run, "summary") or [{}])[-1]
    out: dict[str, Any] = {k: float(v) for k, v in (summary.get("stage_means_s") or {}).items()}
    fwd = [r["t_end"] - r["t_start"] for r in read_records(run, "produce") if "t_start" in r and "t_end" in r]
    out.setdefault("target_forward_s_per_item", sum(fwd) / len(fwd) if fwd else None)
    return out


def pipeline_efficiency(run: Path, metrics: dict[str, Any], n_target: int, n_drafter: int) -> dict[str, Any]:
    """Pipeline items/s against each side alone, each side's capacity from its own busy time in this
    run: targets ``n_target / mean forward per item``; drafters ``items per step / (compute +
    optimizer per step)`` (transfer, gate and peer waits are the pipeline's, not the side's).

    ``value`` is the frozen definition (docs/ARCHITECTURE.md, "Pipeline efficiency"): items/s over the ideal
    from the two sides' rates T and D, ``min(T, D)`` on separate devices and ``1 / (1/T + 1/D)`` when the
    roles take turns on one GPU (``shared_gpu`` in the run's summary)."""
    summary = (read_records(run, "summary") or [{}])[-1]
    st = stages(run)
    fwd = st.get("target_forward_s_per_item")
    target_alone = n_target / fwd if fwd else None
    per_step = sum(st.get(k) or 0.0 for k in ("drafter_compute_s", "optimizer_s"))
    items_per_step = summary.get("trained", 0) / summary["steps"] if summary.get("steps") else None
    drafter_alone = items_per_step / per_step if items_per_step and per_step > 0 else None
    got = metrics.get("items_per_s")

    def ratio(cap: float | None) -> float | None:
        return got / cap if got and cap else None

    slower = min(x for x in (target_alone, drafter_alone) if x) if (target_alone or drafter_alone) else None
    shared = bool(summary.get("shared_gpu"))
    ideal = ideal_items_per_s(target_alone, drafter_alone, shared)
    return {"value": ratio(ideal), "ideal_items_per_s": ideal, "shared_gpu": shared,
            "vs_target_alone": ratio(target_alone), "vs_drafter_alone": ratio(drafter_alone),
            "vs_slower_side": ratio(slower), "target_alone_items_per_s": target_alone,
            "drafter_alone_items_per_s": drafter_alone, "pipeline_items_per_s": got,
            "method": "each side alone from its own busy time per item in this run"}


def ideal_items_per_s(t: float | None, d: float | None, shared_gpu: bool) -> float | None:
    """The pipeline's ideal from the sides' alone rates: ``min(T, D)`` on separate devices; ``1 / (1/T + 1/D)``
    when both take turns on one device (each item costs a forward and a drafter share of the same GPU)."""
    if not t or not d:
        return None
    return 1.0 / (1.0 / t + 1.0 / d) if shared_gpu else min(t, d)


def issue34_figures(run: Path) -> dict[str, dict[str, Any]]:
    """``mfu``, ``wait_peers_s`` and ``shared_gpu`` of a finished run, each as ``{"value", "note"}``."""
    summary = (read_records(run, "summary") or [{}])[-1]
    steps = read_records(run, "step")
    mfus = sorted(float(r["mfu"]) for r in steps if finite(r.get("mfu")) is not None)
    rates = sorted(float(r["flops_per_s"]) for r in steps if finite(r.get("flops_per_s")) is not None)
    wait = (summary.get("stage_means_s") or {}).get("wait_peers_s")
    syncs = [int(r["host_syncs"]) for r in steps if r.get("host_syncs") is not None]
    return {
        "mfu": {"value": mfus[len(mfus) // 2] if mfus else None,
                "flops_per_s": rates[len(rates) // 2] if rates else None,
                "note": "median over the step records (model FLOPs / step time / the drafter GPUs' dense bf16 peak)"
                        if mfus else "n/a: no peak for this device (the CPU, or a GPU the peak table does not know)"},
        "wait_peers_s": {"value": finite(wait), "note": "mean seconds per step in the drafter ranks' collectives "
                                                         "(the slowest rank's lag and the reduction), apart from "
                                                         "optimizer_s"},
        "shared_gpu": {"value": summary.get("shared_gpu"),
                       "note": "the target and drafter ranks take turns on one GPU (pipeline_efficiency's ideal is "
                               "then 1/(1/T + 1/D))", "host_syncs_per_step_max": max(syncs) if syncs else None},
    }


def rank_pids(run: Path) -> dict[int, tuple[int, str]]:
    """pid -> (rank, role) from the produce and take records."""
    out: dict[int, tuple[int, str]] = {}
    for kind, role in (("produce", "target"), ("take", "drafter")):
        for r in read_records(run, kind):
            if "pid" in r and "rank" in r:
                out[int(r["pid"])] = (int(r["rank"]), role)
    return out


def data_plane(run: Path, train_log: str) -> str | None:
    """The plane the run says it uses: a ``data_plane`` field in its summary or config, else its
    ``data plane: NAME`` line."""
    summary = (read_records(run, "summary") or [{}])[-1]
    if summary.get("data_plane"):
        return str(summary["data_plane"])
    m = re.search(r"^data plane: (\S+)", train_log, re.MULTILINE)
    return m.group(1) if m else None


def fidelity(predicted: dict[str, Any], measured: dict[str, Any], knobs: dict[str, Any]) -> dict[str, Any]:
    """Predicted (calibrated simulation) against measured: relative throughput error, absolute
    mix_efficiency error."""
    out: dict[str, Any] = {"configuration": knobs}
    for key in ("throughput_tokens_per_s", "mix_efficiency"):
        p, m = finite(predicted.get(key)), finite(measured.get(key))
        out[key] = {"predicted": p, "measured": m}
        if p is not None and m is not None:
            out[key]["error"] = (p / m - 1.0) if key == "throughput_tokens_per_s" and m else p - m
        else:
            out[key]["error"] = None
    out["throughput_error_kind"], out["mix_efficiency_error_kind"] = "relative", "absolute"
    return out


def finite(x: Any) -> float | None:
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if f == f and abs(f) != float("inf") else None
