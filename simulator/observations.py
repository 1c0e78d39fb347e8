"""What calibration reads: a run's records, or another trainer's per-item timing log.

Run directories (real ``dflash train`` runs or ``dflash simulate --records`` output: same schema)
give worker cycles (see :mod:`simulator.fit`), item shapes, queue bytes and the per-step loss with
the step's bucket make-up. A run's ``config.json`` (real runs) lets the sampler map item ids back
to sequence lengths, so the drafter fit can use the simulator's own anchor counts.

Timing logs are CSV or Parquet, one row per item and role, for pipelines that are not ours:

====================  =====================================================================
column                meaning
====================  =====================================================================
``role``              ``target`` (an item produced) or ``drafter`` (an item or step trained)
``start``, ``end``    seconds, any common origin; busy time = end - start
``tokens``            real (unpadded) tokens of the item
``bucket``            the item's length bucket, 0-based
``worker``            optional: worker index (default 0)
``n_seqs``            optional: sequences in the item (default 1)
``padded_len``        optional, target rows: padded length (default tokens / n_seqs)
``anchors``           optional, drafter rows: anchor positions trained
``bytes``             optional, target rows: bytes of the queued hidden states
``step``, ``loss``    optional, drafter rows: step index and its loss (fits the loss model)
====================  =====================================================================
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.core.config import DflashConfig
from dflash.core.errors import ConfigError
from dflash.core.links import TIER_DEVICE, TIER_NETWORK, TIER_NODE
from dflash.core.precision import state_dtype_bytes
from dflash.core.records import READABLE_VERSIONS, read_records
from dflash.core.run_config import run_config_or_none
from simulator.fit import DrafterObs, Observations, TargetObs
from simulator.loss_model import StepMakeup, makeup_from_takes

LOG_REQUIRED = ("role", "start", "end", "tokens", "bucket")
LOG_SUFFIXES = (".csv", ".parquet", ".pq")


@dataclass
class RunData:
    """One input's observations, its loss make-up, and what is known of its configuration."""

    path: Path
    kind: str  # "run" (our records) or "log"
    obs: Observations
    steps: list[StepMakeup]
    cfg: DflashConfig | None
    n_buckets: int
    item_mix: list[float] | None
    run_id: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"path": str(self.path), "kind": self.kind, "run_id": self.run_id,
                "target_items": len(self.obs.target), "drafter_takes": len(self.obs.drafter),
                "steps_with_loss": sum(s.loss is not None for s in self.steps)}


def load_input(path: str | Path, index: int) -> RunData:
    """A run directory or a timing-log file; a ConfigError naming ``--run`` for anything else."""
    p = Path(path)
    if p.is_dir():
        if not (p / "produce.jsonl").is_file() or not (p / "take.jsonl").is_file():
            raise ConfigError("--run", "must be a run directory with produce.jsonl and take.jsonl records, "
                                       "or a CSV/Parquet timing log", str(p))
        return _from_run(p, index)
    if p.suffix.lower() in LOG_SUFFIXES:
        return _from_log(p, index)
    raise ConfigError("--run", "must be a run directory or a .csv/.parquet timing log", str(p))


def _busy_times(rows: list[dict[str, Any]]) -> list[float]:
    """One worker's target busy times, records in start order: from an item's start to the worker's
    next start, less the time blocked on a full queue, so per-item work outside the forward counts.

    A resumed run's records have holes: items produced but not taken by the checkpoint are dropped
    and produced again later (:func:`dflash.core.records.truncate_after_step`), and a cycle across a
    hole spans the dropped items' work too (seen: 3-230x the forward, against 1.000-1.002 between
    contiguous records on the CPU). A cycle whose time outside the forward exceeds five times the
    worker's median such time (plus 2% of the forward) is taken for a hole: that item's busy time is
    its forward plus the median time outside it."""
    forward = [float(r["t_end"]) - float(r["t_start"]) for r in rows]
    outside = [float(n["t_start"]) - float(r["t_start"]) - float(r.get("blocked_s") or 0.0) - f
               for r, n, f in zip(rows, rows[1:], forward, strict=False)]
    typical = max(0.0, statistics.median(outside)) if outside else 0.0
    busy = [f + o if o <= 5 * typical + 0.02 * f else f + typical for f, o in zip(forward, outside, strict=False)]
    return busy + forward[len(busy):]  # the last item: its forward alone


def check_schema(p: Path, *kinds: list[dict[str, Any]]) -> None:
    """Calibration reads record schemas 1 and 2; any other is refused in one line naming ``--run``."""
    for rows in kinds:
        for r in rows:
            v = r.get("schema_version", 1)
            if v not in READABLE_VERSIONS:
                raise ConfigError("--run", f"must hold records of schema version "
                                           f"{' or '.join(map(str, READABLE_VERSIONS))} (this dflash reads those; "
                                           f"{p} has version {v})", show_got=False)


def v1_transfer(take: dict[str, Any]) -> float | None:
    """A take's ``transfer_s`` as calibration may use it: version 1 records timed a GPU receive behind the
    producer's forward (sends queued on its compute stream), so a version-1 GPU take's is not the move's
    and is left out; CPU ones, and every version-2 one, are the receive alone."""
    t = _number(take.get("transfer_s"))
    if take.get("schema_version", 1) == 1 and str(take.get("device") or "").startswith("cuda"):
        return None
    return t


def _from_run(p: Path, index: int) -> RunData:
    produce = list(read_records(p, "produce"))
    takes = list(read_records(p, "take"))
    check_schema(p, produce, takes)
    steps = {int(r["step"]): r.get("loss") for r in read_records(p, "step")}
    cfg = run_config_or_none(p, "--run")
    obs = Observations()
    by_worker: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in produce:
        by_worker[int(r["worker"])].append(r)
    for w, rows in by_worker.items():
        rows.sort(key=lambda r: r["t_start"])
        for r, busy in zip(rows, _busy_times(rows), strict=True):
            if busy > 0:
                obs.target.append(TargetObs(index, w, float(r["t_start"]), float(busy), int(r["n_seqs"]),
                                            int(r["padded_len"]), int(r["bucket"]), r.get("bytes")))
    sampler = None
    if cfg is not None:
        from dflash.core.sampler import sampler_for
        from dflash.data.lengths import cached_lengths

        table = cached_lengths(cfg.workload, model=cfg.target.model, progress=False)
        sampler = sampler_for(cfg, table.lengths, table.prompt_lengths)
        obs.capture_layers = cfg.target.capture_layers
        obs.dtype_bytes = state_dtype_bytes(cfg.drafter.devices)
    senders = {int(r["rank"]): (r.get("host"), r.get("device")) for r in produce if r.get("rank") is not None}
    by_drafter: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in takes:
        by_drafter[int(r["drafter"])].append(r)
    for d, rows in by_drafter.items():
        rows.sort(key=lambda r: r["t"])
        for r, nxt in zip(rows, [*rows[1:], None], strict=True):
            busy = (nxt["t"] - nxt["wait_s"] - r["t"]) if nxt else r.get("compute_s")
            if busy is None or busy <= 0:
                continue
            lengths = prompts = None
            if sampler is not None:
                try:
                    seqs = [k for i in r["item_ids"] for k in sampler.item(i).seq_indices]
                except (KeyError, IndexError, ValueError):  # ids from another data set: use observed anchors
                    sampler = None
                    continue
                lengths = tuple(sampler.lengths[k] for k in seqs)
                if sampler.prompt_lengths is not None:
                    prompts = tuple(sampler.prompt_lengths[k] for k in seqs)
            obs.drafter.append(DrafterObs(index, d, float(r["t"]), float(busy), int(r.get("tokens") or 0),
                                          int(r["bucket"]), r.get("anchors"), lengths,
                                          cfg.drafter if cfg is not None else None, prompts,
                                          v1_transfer(r), _number(r.get("bytes")),
                                          take_tier(r, senders)))
    n_buckets = sampler.n_buckets if sampler else 1 + max([int(r["bucket"]) for r in takes] or [0])
    mix = sampler.item_mix() if sampler else _observed_mix([int(r["bucket"]) for r in takes], n_buckets)
    make = makeup_from_takes(takes, losses=steps) if steps else []
    run_id = produce[0].get("run_id") if produce else None
    return RunData(p, "run", obs, make, cfg, n_buckets, mix, run_id)


def take_tier(take: dict[str, Any], senders: dict[int, tuple[Any, Any]]) -> str | None:
    """The placement tier (:mod:`dflash.core.links`) every move of a real take ran in, from what the
    records say of both ends: ``network`` only when they name two hosts; ``device`` when one host and
    one device; ``node`` when one host and two devices, or when the records name no host or device
    (records from before they did, or simulated ones: a run on one node, as every run was then). None
    when the take's moves spanned tiers."""
    producers = take.get("producers")
    if not producers:
        return TIER_NODE if take.get("transfer_s") is not None else None
    tiers = set()
    for p in producers:
        host, device = senders.get(int(p), (None, None))
        if host is None or take.get("host") is None:
            tiers.add(TIER_NODE)
        elif host != take["host"]:
            tiers.add(TIER_NETWORK)
        elif device is not None and device == take.get("device"):
            tiers.add(TIER_DEVICE)
        else:
            tiers.add(TIER_NODE)
    return tiers.pop() if len(tiers) == 1 else None


def _observed_mix(buckets: list[int], n: int) -> list[float]:
    counts = [0] * n
    for b in buckets:
        counts[b] += 1
    total = sum(counts) or 1
    return [c / total for c in counts]


def _from_log(p: Path, index: int) -> RunData:
    import pandas as pd

    try:
        df = pd.read_parquet(p) if p.suffix.lower() in (".parquet", ".pq") else pd.read_csv(p)
    except Exception as exc:
        raise ConfigError("--run", f"must be a readable CSV/Parquet timing log ({type(exc).__name__})",
                          str(p)) from None
    missing = [c for c in LOG_REQUIRED if c not in df.columns]
    if missing:
        raise ConfigError("--run", f"timing log needs columns {', '.join(LOG_REQUIRED)} (missing: "
                                   f"{', '.join(missing)})", str(p))
    roles = set(df["role"].astype(str))
    if not roles <= {"target", "drafter"}:
        raise ConfigError("--run", "timing log 'role' must be 'target' or 'drafter'", sorted(roles - {"target",
                                                                                                        "drafter"}))
    bad = df[(df["end"] < df["start"]) | (df["tokens"] < 1) | (df["bucket"] < 0)]
    if len(bad):
        raise ConfigError("--run", f"timing log rows need end >= start, tokens >= 1, bucket >= 0 (first bad row "
                                   f"{int(bad.index[0])})", str(p))
    obs = Observations()
    def get(row: dict[str, Any], col: str, default: Any) -> Any:
        return row[col] if col in df.columns and not _isnan(row[col]) else default

    takes, losses = [], {}
    for k, row in enumerate(df.to_dict("records")):
        n_seqs = int(get(row, "n_seqs", 1))
        busy = float(row["end"]) - float(row["start"])
        if busy <= 0:
            continue
        if row["role"] == "target":
            padded = int(get(row, "padded_len", math.ceil(row["tokens"] / n_seqs)))
            obs.target.append(TargetObs(index, int(get(row, "worker", 0)), float(row["start"]), busy, n_seqs,
                                        padded, int(row["bucket"]), get(row, "bytes", None)))
        else:
            obs.drafter.append(DrafterObs(index, int(get(row, "worker", 0)), float(row["start"]), busy,
                                          int(row["tokens"]), int(row["bucket"]), get(row, "anchors", None)))
            step = int(get(row, "step", k))
            takes.append({"step": step, "bucket": int(row["bucket"]), "tokens": int(row["tokens"]), "item_ids": []})
            if "loss" in df.columns and not _isnan(row["loss"]):
                losses[step] = float(row["loss"])
    n_buckets = 1 + int(df["bucket"].max())
    mix = _observed_mix([int(b) for b in df.loc[df["role"] == "drafter", "bucket"]], n_buckets)
    make = makeup_from_takes(takes, losses=losses) if losses else []
    return RunData(p, "log", obs, make, None, n_buckets, mix)


def _number(v: Any) -> float | None:
    """A finite number from a record field, or None (absent, null or NaN: older records)."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _isnan(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))
