"""Where a target's regenerated data set lives, and when it may be trained on.

``dflash regenerate`` answers the data set's prompts with the target itself; training on those
replies is what DFlash's recipe does. Without ``--out`` it writes the *cache*:
``<cache dir>/regenerated/<target identity>.jsonl`` (cache dir: :mod:`dflash.data.cache_dir`), with
the two files every regenerated data set has beside it (``.meta.json``, the sidecar, and
``.failed.jsonl``). ``[workload] dataset = "auto"`` trains on that file when it is complete.

Why a work file: a regeneration takes ~40 minutes per 1,000 prompts on a CPU and may be killed, and
a half-finished file must never become the training set. So a run writes and resumes
``<identity>.partial.jsonl`` and moves it into place (``os.replace``, atomic) only when its run ends
``finished``; extending a published cache copies it to the work file first, so the published file
stays whole meanwhile. A reader also checks the sidecar's last run says ``finished``, so a file
someone wrote there directly with ``--out`` is not picked up while it is being written.

Target identity: ``smollm2`` for the packaged model; otherwise the model's name made filename-safe
plus a short hash of its resolved path (a local directory or file) or of the hub id as given (with
any revision in it), so two models never share a file. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from dflash.data.cache_dir import default_cache_dir

FORMAT = "dflash-regenerate/1"  # the sidecar's format tag (dflash.regenerate writes it)
SUBDIR = "regenerated"
PACKAGED_TARGET = "smollm2"
RATE_PROMPTS_PER_S = 0.42  # measured: packaged SmolLM2, 2 CPU cores, batch 8 (benchmarks/RESULTS.md)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


# --------------------------------------------------------------------------- the files of a data set
def sidecar_path(out: Path) -> Path:
    return out.with_name(out.name + ".meta.json")


def failed_path(out: Path) -> Path:
    return out.with_name(out.name + ".failed.jsonl")


def companions(out: Path) -> tuple[Path, Path, Path]:
    """The data file and the two beside it, in the order they are moved into place."""
    return out, failed_path(out), sidecar_path(out)


# --------------------------------------------------------------------------- where the cache is
def target_identity(model: str) -> str:
    """A stable, filename-safe name for ``target.model`` (module docstring)."""
    if model == PACKAGED_TARGET:
        return PACKAGED_TARGET
    p = Path(model).expanduser()
    if p.exists():
        name, key = (p.stem if p.is_file() else p.name), str(p.resolve())
    else:  # a hub id, perhaps with a revision: the string is its identity
        name, key = model.rstrip("/").split("/")[-1], model
    safe = _UNSAFE.sub("-", name).strip("-.")[:40] or "model"
    return f"{safe}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def cache_path(model: str, cache_dir: Path | None = None) -> Path:
    """The published regenerated data set of ``model``."""
    root = cache_dir if cache_dir is not None else default_cache_dir()
    return root / SUBDIR / f"{target_identity(model)}.jsonl"


def work_path(published: Path) -> Path:
    """Where a regeneration into the cache writes and resumes until it is complete."""
    return published.with_name(published.stem + ".partial.jsonl")


# --------------------------------------------------------------------------- is it usable
@dataclass(frozen=True)
class CacheState:
    """What the cache holds for one target: ``complete`` (train on ``path``), ``incomplete`` or ``absent``."""

    model: str
    path: Path
    state: str
    records: int = 0

    @property
    def complete(self) -> bool:
        return self.state == "complete"


def cache_state(model: str, cache_dir: Path | None = None) -> CacheState:
    """Is there a complete regenerated data set of ``model`` in the cache? Reads only the sidecar."""
    path = cache_path(model, cache_dir)
    meta = _sidecar(path)
    if meta is not None and path.is_file() and path.stat().st_size > 0 and _finished(meta):
        records = meta.get("counts", {}).get("records", 0)
        return CacheState(model, path, "complete", records if isinstance(records, int) else 0)
    started = path.exists() or sidecar_path(path).exists() or work_path(path).exists()
    return CacheState(model, path, "incomplete" if started else "absent")


def _sidecar(path: Path) -> dict | None:
    try:
        meta = json.loads(sidecar_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else None


def _finished(meta: dict) -> bool:
    runs = meta.get("runs")
    return isinstance(runs, list) and bool(runs) and isinstance(runs[-1], dict) and runs[-1].get("status") == "finished"


# --------------------------------------------------------------------------- writing into it
def start_work(published: Path) -> Path:
    """The work file of a regeneration into the cache: resumed where a killed run left it, else a
    copy of the published data set (so an extension never touches the published files)."""
    work = work_path(published)
    if not work.exists() and published.is_file():
        for src, dst in zip(companions(published), companions(work), strict=True):
            if src.is_file():
                shutil.copyfile(src, dst)
    return work


def publish(work: Path, published: Path) -> None:
    """Move a finished work file into place: data first, sidecar last (each ``os.replace`` is atomic)."""
    for src, dst in zip(companions(work), companions(published), strict=True):
        if src.is_file():
            os.replace(src, dst)

