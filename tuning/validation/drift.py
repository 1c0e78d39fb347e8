"""Machine drift: how much a validated run's per-item costs moved from the calibration's.

A prediction error mixes two things: the machine got faster or slower between the calibration run
and the validation (drift), and the simulator's queue model is wrong (model error). To tell them
apart, each validated run is calibrated *alone* (:func:`simulator.calibration.calibrate` on its
records) and both cost models, the calibration's and the run's own, are evaluated on the *same*
work: the run's own produced items (target) and takes (drafter). Their ratio is the drift, free of
any difference in what was produced. The queue dynamics stay simulated: the run is re-predicted
under its own costs, and that error is the model's (``throughput_error_drift_corrected``).

``summary`` is the drift's effect on the predicted throughput: a-priori prediction over the
drift-corrected one, minus 1, so that (1 + a-priori error) = (1 + summary) (1 + corrected error).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from dflash.core.config import DflashConfig, TimingConfig, with_overrides
from dflash.core.records import read_records


def timing_of(base: DflashConfig, timing: dict[str, Any]) -> TimingConfig:
    return with_overrides(base, {f"timing.{k}": v for k, v in timing.items()}).timing


def mean_costs(run_dir: Path, timing: TimingConfig) -> tuple[float | None, float | None]:
    """(mean seconds per produced item, mean seconds per take) of the run's own work under ``timing``."""
    from simulator.timing import DrafterTime, TargetTime

    rng = random.Random(0)
    tt, dt = TargetTime(timing, rng), DrafterTime(timing, rng)
    items = [tt.mean(int(r.get("n_seqs") or 1), int(r["padded_len"])) for r in read_records(run_dir, "produce")
             if r.get("padded_len") is not None]
    takes = [dt.mean(int(r.get("tokens") or 0), int(r.get("anchors") or 0)) for r in read_records(run_dir, "take")]
    return (sum(items) / len(items) if items else None, sum(takes) / len(takes) if takes else None)


def stage_drift(run_dir: Path, calibration: TimingConfig, own: TimingConfig) -> dict[str, float | None]:
    """Relative change of the per-item costs, target and drafter, from ``calibration`` to ``own``."""
    cal_t, cal_d = mean_costs(run_dir, calibration)
    own_t, own_d = mean_costs(run_dir, own)

    def rel(new: float | None, old: float | None) -> float | None:
        return None if new is None or not old else new / old - 1.0

    return {"target": rel(own_t, cal_t), "drafter": rel(own_d, cal_d),
            "target_s_per_item": own_t, "target_s_per_item_calibration": cal_t,
            "drafter_s_per_take": own_d, "drafter_s_per_take_calibration": cal_d}


def own_calibration(run_dir: Path, base: DflashConfig, out: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The run's records calibrated alone, written to ``out``; (None, why) when they cannot be."""
    from dflash.core.errors import ConfigError
    from simulator.calibration import calibrate, write_calibration

    try:
        data = calibrate([run_dir], base)
    except (ConfigError, ValueError) as exc:
        return None, exc.line() if isinstance(exc, ConfigError) else str(exc)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_calibration(data, out)
    return data, None


def effect(apriori: float | None, corrected: float | None) -> float | None:
    """The drift's effect on predicted throughput (see the module docstring)."""
    return None if apriori is None or not corrected else apriori / corrected - 1.0
