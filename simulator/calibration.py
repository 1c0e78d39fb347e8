"""Calibration files: fitted by ``dflash calibrate``, applied by ``simulate``/``sweep``/``validate``.

A calibration file is JSON (or TOML) with a ``timing`` table of :class:`dflash.core.config.TimingConfig`
keys and optionally a ``loss_model`` table of :class:`dflash.core.config.LossModelConfig` keys; the
fitted values replace the configured ones and are validated like any other config value. The other
tables (``fit``: errors per role; ``runs``: what was fitted) are for people and reports.
"""

from __future__ import annotations

import json
import math
import platform
import sys
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash.core.config import DATASET_AUTO, DflashConfig, with_overrides
from dflash.core.errors import ConfigError

APPLIED_TABLES = ("timing", "loss_model")


def read_calibration(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
        data = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
    except (OSError, ValueError) as exc:
        raise ConfigError("--calibration", f"must be a readable JSON or TOML calibration file ({exc})",
                          str(path), show_got=False) from None
    if not isinstance(data, dict) or not isinstance(data.get("timing"), dict):
        raise ConfigError("--calibration", "must contain a 'timing' table", str(path))
    return data


def apply_calibration(cfg: DflashConfig, path: str | Path | None, warn: bool = True) -> DflashConfig:
    """``cfg`` with the file's fitted tables; a warning on stderr when the file was fitted to another
    model, drafter or bucketing than ``cfg`` describes (the rates would then be someone else's)."""
    if path is None:
        return cfg
    data = read_calibration(path)
    if warn and isinstance(data.get("profile"), dict):
        diff = profile_differences(data["profile"], _profile(cfg))
        if diff:
            print(f"dflash: warning: {path} was fitted to another setup: {'; '.join(diff)}", file=sys.stderr)
    overrides = {f"{table}.{k}": v for table in APPLIED_TABLES for k, v in (data.get(table) or {}).items()}
    return with_overrides(cfg, overrides)


def calibrate(paths: Sequence[str | Path], base: DflashConfig, seed: int = 0) -> dict[str, Any]:
    """Fit timing (and, where the runs have losses, the loss model) to one or more inputs.

    Runs are pooled for timing, so they must share target, drafter architecture and bucketing
    (anchor counts may differ: that is how per-token and per-anchor costs get separated). The loss
    model comes from the input with the most steps with a loss, since each run has its own trend.
    """
    from dflash import __version__
    from simulator.fit import MIN_OBSERVATIONS, Observations, fit_timing
    from simulator.loss_model import fit_loss_model
    from simulator.observations import load_input

    inputs = [load_input(p, i) for i, p in enumerate(paths)]
    _check_compatible(inputs)
    obs = Observations(capture_layers=inputs[0].obs.capture_layers, dtype_bytes=inputs[0].obs.dtype_bytes)
    for run in inputs:
        obs.target += run.obs.target
        obs.drafter += run.obs.drafter
    if len(obs.target) < MIN_OBSERVATIONS or len(obs.drafter) < MIN_OBSERVATIONS:
        raise ConfigError("--run", f"runs too short to fit: {len(obs.target)} target items and {len(obs.drafter)} "
                                   f"drafter takes in all (need >= {MIN_OBSERVATIONS} of each)",
                          [str(p) for p in paths], show_got=False)
    run_cfg = next((r.cfg for r in inputs if r.cfg is not None), None)
    base_timing = (run_cfg or base).timing
    n_buckets = max(r.n_buckets for r in inputs)
    timing, fit_report = fit_timing(obs, base_timing, n_buckets, seed=seed)
    out: dict[str, Any] = {"schema": 1, "timing": timing}
    with_loss = [r for r in inputs if sum(s.loss is not None for s in r.steps) > 0]
    if with_loss:
        best = max(with_loss, key=lambda r: sum(s.loss is not None for s in r.steps))
        loss_fit = fit_loss_model(best.steps, best.item_mix or [1.0 / n_buckets] * n_buckets)
        if loss_fit is not None:
            out["loss_model"] = {k: list(v) if isinstance(v, tuple) else v
                                 for k, v in loss_fit.model.__dict__.items()}
            fit_report["loss"] = {"from": str(best.path), **loss_fit.as_json()}
        else:
            fit_report["loss"] = {"from": str(best.path), "skipped": "too few steps with a loss"}
    out["fit"] = fit_report
    out["runs"] = [r.describe() for r in inputs]
    out["profile"] = _profile(run_cfg) if run_cfg is not None else None
    out["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    out["host"] = platform.node()
    out["dflash_version"] = __version__
    return out


DATA_KEYS = ("dataset", "dataset_fingerprint")


def profile_differences(fitted: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """What differs between the setup a calibration was fitted to and ``ours``, in words.

    The data is compared by content where both sides know it (``dataset_fingerprint``, pinned by
    every run since the dataset choice became "auto"), so "auto" in one place and the file it
    resolved to in the other is the same data; a file fitted before pinning (no fingerprint, maybe
    "auto") is compared by name only when neither name is "auto", since "auto" names no file."""
    diff = [f"{k} {v!r} (config: {ours[k]!r})" for k, v in fitted.items()
            if k in ours and k not in DATA_KEYS and ours[k] != v]
    f_print, o_print = fitted.get("dataset_fingerprint"), ours.get("dataset_fingerprint")
    if f_print and o_print:
        if f_print != o_print:
            diff.append(f"data {fitted.get('dataset')!r} with fingerprint {f_print} (config: "
                        f"{ours.get('dataset')!r}, fingerprint {o_print}): the length mix and loss levels differ")
    else:
        names = (fitted.get("dataset"), ours.get("dataset"))
        if "dataset" in fitted and DATASET_AUTO not in names and names[0] != names[1]:
            diff.append(f"dataset {names[0]!r} (config: {names[1]!r})")
    return diff


def _profile(cfg: DflashConfig) -> dict[str, Any]:
    """What the fitted rates belong to: change any of these and the calibration no longer applies."""
    return {"target": cfg.target.model, "target_devices": list(cfg.target.devices),
            "drafter_devices": list(cfg.drafter.devices), "drafter_layers": cfg.drafter.layers,
            "block_size": cfg.drafter.block_size, "anchors": cfg.drafter.anchors,
            "capture_layers": cfg.target.capture_layers, "bucket_bounds": list(cfg.workload.bucket_bounds),
            "dataset": cfg.workload.dataset, "dataset_fingerprint": cfg.workload.dataset_fingerprint,
            "sample": cfg.workload.sample, "max_len": cfg.workload.max_len}


def _check_compatible(inputs: Sequence[Any]) -> None:
    keyed = [(r.path, _profile(r.cfg)) for r in inputs if r.cfg is not None]
    if not keyed:
        return
    ignore = {"anchors", "target_devices", "drafter_devices"}
    first = {k: v for k, v in keyed[0][1].items() if k not in ignore}
    for path, prof in keyed[1:]:
        diff = [k for k, v in first.items() if k not in DATA_KEYS and prof[k] != v]
        if profile_differences({k: first[k] for k in DATA_KEYS}, {k: prof[k] for k in DATA_KEYS}):
            diff.append("data")
        if diff:
            raise ConfigError("--run", f"runs fitted together must share {', '.join(diff)} ({keyed[0][0]} and "
                                       f"{path} differ); calibrate them separately", str(path), show_got=False)


def write_calibration(data: dict[str, Any], path: str | Path) -> Path:
    """Atomically: a killed calibrate leaves the old file or the new one, never half of one."""
    from dflash.core.atomic import atomic_write_text

    if Path(path).suffix == ".toml":
        raise ConfigError("--out", "must be a .json file (calibrations are written as JSON)", str(path))
    return atomic_write_text(path, json.dumps(data, indent=1, default=float))


def format_calibration(data: dict[str, Any]) -> str:
    """A few lines a person reads: the fitted rates and how well they fit."""
    t, fit = data["timing"], data["fit"]
    lines = [
        f"target: {t['target_fixed_s'] * 1e3:.1f} ms + {t['target_per_token_s'] * 1e6:.2f} us/token"
        f" + {t['target_per_token2_s'] * 1e9:.3f} ns/token^2 per item; MAPE {100 * fit['target']['mape']:.1f}% "
        f"(cv {fit['target']['cv']:.2f}, {fit['target']['n']} items)",
        f"drafter: {t['drafter_fixed_s'] * 1e3:.1f} ms + {t['drafter_per_token_s'] * 1e6:.2f} us/token + "
        f"{t['drafter_per_anchor_s'] * 1e3:.3f} ms/anchor per take (anchors {fit['drafter']['anchors']}, "
        f"response_fraction {t['response_fraction']}); MAPE {100 * fit['drafter']['mape']:.1f}% "
        f"(cv {fit['drafter']['cv']:.2f}, {fit['drafter']['n']} takes"
        + ("" if fit["drafter"].get("separable", True) else "; per-token and per-anchor terms not separable "
           "from these runs: add a run with another anchor count") + ")",
        "supply burstiness: " + (f"amplitude {t['burst_amplitude']:.2f}, period {t['burst_period_s']:.0f} s"
                                 if fit["burst"]["detected"] else
                                 f"none detected (best sinusoid explains {100 * fit['burst']['r2']:.1f}%)"),
    ]
    if "memory" in fit:
        lines.append(f"queue memory: {fit['memory']['bytes_per_token']:,.0f} bytes per padded token")
    for tier, tr in fit.get("transfer", {}).items():
        lines.append(f"hidden-state moves ({tier} tier): {tr['s_per_byte'] * 1e9:.3f} ns/byte ({_f(tr['gb_per_s'])} "
                     f"GB/s) from {tr['n']} timed takes; taken off the drafter's busy time before its fit")
    loss = fit.get("loss")
    if loss and "r2" in loss:
        lm = data["loss_model"]
        rel = ", ".join(f"{100 * math.expm1(b):+.0f}%" for b in lm["bucket_log_mean"])
        sd = ", ".join(f"{s:.3f}" for s in lm["bucket_log_sd"])
        lines.append(f"loss model ({loss['steps']} steps, R^2 {loss['r2']:.2f}): bucket effects {rel}; "
                     f"log-loss noise sd {sd}; lag-1 autocorr {lm['autocorr']:.2f}; loss_roughness measured "
                     f"{_f(loss['measured_loss_roughness'])}, replayed {_f(loss['replayed_loss_roughness'])}")
    elif loss:
        lines.append(f"loss model: {loss.get('skipped')}")
    return "\n".join(lines)


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"
