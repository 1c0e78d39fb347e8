"""What the verbs read back from a run directory that ``dflash train`` wrote."""

from __future__ import annotations

import json
from pathlib import Path

from dflash.core.errors import ConfigError
from dflash.core.run_config import load_run_config  # noqa: F401  (re-exported: dflash.cli.load_run_config)
from dflash.data.trained import trained_conversation_ids  # noqa: F401  (re-exported: its home is dflash.data)


def drafter_dirs(path: Path, flag: str = "--drafter") -> tuple[Path, Path]:
    """(run directory, drafter directory) for a run directory or the drafter directory inside one.

    The drafter directory must hold a readable spec (a JSON object) and the weights file, so a
    damaged or half-copied drafter is one line here, before a target is loaded for it.
    """
    from dflash.model.drafter import CONFIG_FILE, WEIGHTS_FILE

    drafter = path / "drafter" if (path / "drafter").is_dir() else path
    if not (drafter / CONFIG_FILE).is_file():
        raise ConfigError(flag, f"must be a dflash train run directory (with drafter/{CONFIG_FILE}) or its drafter "
                          "directory", str(path))
    try:
        spec = json.loads((drafter / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(flag, f"has a {CONFIG_FILE} that cannot be read as JSON ({type(exc).__name__}); the "
                          "drafter directory is damaged", str(path)) from None
    if not isinstance(spec, dict) or "spec" not in spec:
        raise ConfigError(flag, f"has a {CONFIG_FILE} without the drafter's 'spec'; the drafter directory is damaged",
                          str(path))
    if not (drafter / WEIGHTS_FILE).is_file():
        raise ConfigError(flag, f"has no {WEIGHTS_FILE} next to {CONFIG_FILE}; the drafter directory is incomplete",
                          str(path))
    return (path if drafter != path else path.parent), drafter
