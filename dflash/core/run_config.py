"""A run directory's ``config.json``: the one place that writes it and reads it back.

The trainer writes the config it ran with; ``--resume``, ``tune-live``, ``eval``, ``export`` and
``calibrate`` read it back. One home keeps the rules alike: written whole or not at all (a kill
mid-write must not leave a run that cannot resume), and a damaged file is one line naming the
parameter, never a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash.core.atomic import atomic_write_text
from dflash.core.config import DflashConfig, config_from_dict
from dflash.core.errors import ConfigError
from dflash.core.records import clean_json

FILE = "config.json"


def write_run_config(run: Path, cfg: DflashConfig) -> Path:
    return atomic_write_text(Path(run) / FILE, json.dumps(clean_json(cfg.to_dict()), indent=1, default=str))


def load_run_config(run: Path, param: str = "RUN_DIR") -> DflashConfig:
    """The config a ``dflash train`` run stored in its directory; ``param`` names the flag in errors."""
    path = Path(run) / FILE
    if not path.is_file():
        raise ConfigError(param, "must be a dflash train run directory (it has no config.json)", str(run))
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(param, f"has a config.json that cannot be read as JSON ({type(exc).__name__}); "
                          "the run directory is damaged", str(run)) from None
    if not isinstance(data, dict):
        raise ConfigError(param, "has a config.json that is not a JSON object; the run directory is damaged",
                          str(run))
    try:
        return config_from_dict({k: v for k, v in data.items() if v is not None})
    except (ValueError, TypeError, AttributeError) as exc:  # ConfigError is a ValueError
        why = exc.line() if isinstance(exc, ConfigError) else type(exc).__name__
        raise ConfigError(param, f"has a config.json that is not a valid config ({why})", str(run)) from None


def run_config_or_none(run: Path, param: str = "RUN_DIR") -> DflashConfig | None:
    """As :func:`load_run_config`, but None for a directory without one (simulator records, logs)."""
    return load_run_config(run, param) if (Path(run) / FILE).is_file() else None
