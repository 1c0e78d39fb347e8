"""Apply a calibration file (written by ``dflash calibrate``) to a configuration.

A calibration file is JSON (or TOML) with a ``timing`` table of :class:`dflash.config.TimingConfig`
keys; the fitted values replace the configured ones, and every value is validated like any other.
Other tables (fit errors, loss statistics) are carried along for reports.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from dflash.config import DflashConfig, with_overrides
from dflash.errors import ConfigError


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


def apply_calibration(cfg: DflashConfig, path: str | Path | None) -> DflashConfig:
    if path is None:
        return cfg
    timing = read_calibration(path)["timing"]
    return with_overrides(cfg, {f"timing.{k}": v for k, v in timing.items()})
