"""What the verbs read back from a run directory that ``dflash train`` wrote."""

from __future__ import annotations

import json
from pathlib import Path

from dflash.core.config import DflashConfig, config_from_dict
from dflash.core.errors import ConfigError


def load_run_config(run: Path) -> DflashConfig:
    """The config a `dflash train` run stored in its directory."""
    path = run / "config.json"
    if not path.is_file():
        raise ConfigError("RUN_DIR", "must be a dflash train run directory (it has no config.json)", str(run))
    data = json.loads(path.read_text())
    return config_from_dict({k: v for k, v in data.items() if v is not None})


def trained_conversation_ids(run_dir: Path, cfg: DflashConfig) -> set[str]:
    """Conversation ids of every item a run's take records show (to keep evaluation held out)."""
    from dflash.core.records import read_records

    item_ids = [i for r in read_records(run_dir, "take") for i in r["item_ids"]]
    if not item_ids:
        return set()
    from dflash.core.sampler import Sampler
    from dflash.data.lengths import cached_lengths

    table = cached_lengths(cfg.workload, model=cfg.target.model, progress=False)
    sampler = Sampler(table.lengths, cfg.workload, seed=cfg.seed)
    return {table.ids[k] for k in sampler.sequences_of(item_ids)}
