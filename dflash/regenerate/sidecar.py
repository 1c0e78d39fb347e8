"""The sidecar ``DATA.jsonl.meta.json``: the settings the records depend on, the target's identity,
counts, and one entry per run with its timestamps and speed.

Why: a file whose sidecar shows other settings (back end, turns, max-new-tokens, temperature,
top-p, the seed when sampling, data set, target weights or chat template, or the server's model)
is never extended: mixing them would leave a data set no setting describes. The check is one line,
before anything is written. The sidecar is rewritten atomically at the start, every 10 s and at the
end, so a reader sees the old one or the new one, never half of one. Torch-free.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dflash.core.atomic import atomic_write_text
from dflash.core.errors import ConfigError
from dflash.regenerate.options import Options
from dflash.regenerate.progress import Progress
from dflash.regenerate.writer import FORMAT, Existing, now_iso, sidecar_path

SIDECAR_EVERY_S = 10.0
# Which part of the target's identity the records depend on, per back end.
TARGET_KEYS = {"transformers": ("weights_sha", "chat_template_sha"), "server": ("server_model",)}


def dataset_identity(path: Path, name: str) -> dict[str, Any]:
    return {"name": name if name == "sharegpt" else path.name, "bytes": path.stat().st_size}


def run_settings(opts: Options, dataset: dict[str, Any]) -> dict[str, Any]:
    """What the records depend on (compared before extending a file); the target joins after loading."""
    return {"backend": opts.backend, "turns": opts.turns, "max_new_tokens": opts.max_new_tokens,
            "temperature": opts.temperature, "top_p": opts.top_p,
            "seed": opts.seed if opts.sampling else None, "dataset": dataset}


def with_target(settings: dict[str, Any], target: dict[str, Any]) -> dict[str, Any]:
    keys = TARGET_KEYS[settings["backend"]]
    return {**settings, "target": {k: target[k] for k in keys if k in target}}


def compare_settings(old: dict[str, Any], new: dict[str, Any], out: Path, keys: Iterable[str] | None = None) -> None:
    """Refuse to extend a file made with other settings: the first difference, on one line."""
    for key in (keys if keys is not None else sorted(set(old) | set(new))):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            for sub in sorted(set(a) | set(b)):
                if a.get(sub) != b.get(sub):
                    raise ConfigError("--out", f"was generated with other settings ({key}.{sub}: {a.get(sub)!r} "
                                      f"there, {b.get(sub)!r} now); use the same settings or another --out", str(out))
        elif a != b:
            raise ConfigError("--out", f"was generated with other settings ({key}: {a!r} there, {b!r} now); "
                              "use the same settings or another --out", str(out))


class Session:
    """The sidecar of this run: the runs before it, and this run's entry updated as it goes."""

    def __init__(self, opts: Options, settings: dict[str, Any], target: dict[str, Any],
                 existing: Existing, selection: dict[str, Any]) -> None:
        self.path = sidecar_path(opts.out)
        old = existing.sidecar or {}
        self.created = old.get("created", now_iso())
        self.runs: list[dict[str, Any]] = list(old.get("runs", []))
        self.settings = settings
        self.target = target
        self.base_records = existing.records
        self.selection = selection
        keys = ("limit", "url", "concurrency", "retries", "timeout") if opts.backend == "server" else (
            "limit", "batch_size", "device")
        self.run: dict[str, Any] = {"started": now_iso(), "ended": None, "status": "running",
                                    **{k: getattr(opts, k) for k in keys}}
        self.runs.append(self.run)
        self.last = 0.0

    def write(self, progress: Progress, status: str | None = None, force: bool = True) -> None:
        """Rewrite the sidecar (``force`` False: only when the last write is 10 s old); ``status`` ends the run."""
        now = time.perf_counter()
        if not force and now - self.last < SIDECAR_EVERY_S:
            return
        self.last = now
        if status is not None:
            self.run["status"] = status
            self.run["ended"] = now_iso()
        pps, tps = progress.rates()
        self.run.update(records_written=progress.records, failed=progress.failed, skipped=progress.skipped,
                        prompts=progress.replies, new_tokens=progress.tokens,
                        generate_s=round(progress.elapsed, 3), prompts_per_s=round(pps, 4),
                        tokens_per_s=round(tps, 2))
        meta = {"format": FORMAT, "settings": self.settings, "target": self.target,
                "counts": {"records": self.base_records + progress.records, "failed_last_run": progress.failed,
                           "skipped_last_run": progress.skipped, **self.selection},
                "created": self.created, "updated": now_iso(), "runs": self.runs}
        atomic_write_text(self.path, json.dumps(meta, indent=1, ensure_ascii=False) + "\n")
