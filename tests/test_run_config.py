"""A run directory's config.json: written whole, read back equal, damage is one line naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash.core.config import DflashConfig, with_overrides
from dflash.core.errors import ConfigError
from dflash.core.run_config import load_run_config, run_config_or_none, write_run_config


def test_round_trip_keeps_every_key(tmp_path: Path) -> None:
    cfg = with_overrides(DflashConfig(), {"queue.min_ready": 7, "train.max_steps": 12})
    write_run_config(tmp_path, cfg)
    assert load_run_config(tmp_path).to_dict() == cfg.to_dict()
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]  # no temporary file left behind


@pytest.mark.parametrize(("content", "why"), [
    ("{not json", "cannot be read as JSON"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({"queue": {"min_ready": -3}}), "not a valid config"),
])
def test_damaged_config_is_one_line_naming_the_parameter(tmp_path: Path, content: str, why: str) -> None:
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ConfigError) as exc:
        load_run_config(tmp_path, "--run")
    assert exc.value.line().startswith("--run") and why in exc.value.line() and "\n" not in exc.value.line()


def test_directory_without_config(tmp_path: Path) -> None:
    assert run_config_or_none(tmp_path) is None
    with pytest.raises(ConfigError, match=r"no config\.json"):
        load_run_config(tmp_path)


def test_an_unset_override_reaches_the_run_and_none_keeps_the_value(tmp_path: Path) -> None:
    """``UNSET`` turns an optional key off (the run's config.json, which every rank reads, says so);
    ``None`` is no override; a key without an unset value is one line naming it."""
    from dflash.core.config import UNSET

    base = with_overrides(DflashConfig(), {"train.max_minutes": 5.0, "train.eval_every": 10, "train.max_steps": 40})
    cfg = with_overrides(base, {"train.max_minutes": UNSET, "train.eval_every": UNSET, "train.max_steps": None})
    write_run_config(tmp_path, cfg)
    run = load_run_config(tmp_path)
    assert run.train.max_minutes is None and run.train.eval_every is None  # unset, as the run reads it
    assert run.train.max_steps == 40  # None: kept
    with pytest.raises(ConfigError, match=r"train\.lr: cannot be unset"):
        with_overrides(base, {"train.lr": UNSET})
    import pickle

    assert pickle.loads(pickle.dumps(UNSET)) is UNSET  # a spawned rank's spec may carry it
