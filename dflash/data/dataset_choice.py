"""Which data file a run trains on, said once and pinned into its config.

``[workload] dataset = "auto"`` means "the target's own replies when ``dflash regenerate`` has
cached them, else the packaged ShareGPT". A run must not change its mind: item ids index one
file's conversations, so calibration, sweep, simulation, validation and a resumed run all have to
read the same file. :func:`pin_dataset` therefore resolves the value once, prints one line saying
what was chosen, and returns the config with the concrete value (``"sharegpt"`` or the file's
path) and the file's content fingerprint; that config is what a run writes to ``config.json``.
A pinned config whose file has changed since (another fingerprint) is refused. Torch-free.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash.core.config import DATASET_AUTO, DATASET_PACKAGED, DflashConfig, with_overrides
from dflash.core.errors import ConfigError
from dflash.data.conversations import packaged_sharegpt_path, resolve_dataset
from dflash.data.regenerated_cache import RATE_PROMPTS_PER_S, CacheState, cache_state

KINDS = ("regenerated", "packaged", "file")


def fingerprint(path: Path) -> str:
    """sha256 of the file's content, 16 hex digits (~0.1 s for the 125 MB packaged ShareGPT)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()[:16]


@dataclass(frozen=True)
class DataChoice:
    """The file a ``workload.dataset`` value resolved to, and why (``cache``: the state seen for "auto")."""

    value: str
    target: str
    path: Path
    kind: str
    fingerprint: str
    cache: CacheState | None = None

    @property
    def pinned_value(self) -> str:
        """What the run's config says from now on: the packaged name, or the file's path."""
        return DATASET_PACKAGED if self.kind == "packaged" else str(self.path)

    def line(self) -> str:
        """One line for the start of a run: which file, and for "auto" without a cache how to get one."""
        if self.kind == "regenerated":
            n = self.cache.records if self.cache is not None else 0
            return f"data: regenerated replies of {self.target}, {n} conversations ({_short(self.path)})"
        if self.kind == "file":
            return f"data: {_short(self.path)} (workload.dataset)"
        if self.cache is None:
            return f'data: packaged ShareGPT (workload.dataset = "{DATASET_PACKAGED}")'
        minutes = 1000 / RATE_PROMPTS_PER_S / 60
        if self.cache.state == "incomplete":
            why = (f"the regenerated cache for {self.target} is incomplete: run `dflash regenerate` again to "
                   "finish it")
        else:
            why = f"no regenerated cache for {self.target}: `dflash regenerate` makes one"
        return (f"data: packaged ShareGPT ({why}, ~{minutes:.0f} min per 1,000 prompts at "
                f"{RATE_PROMPTS_PER_S} prompts/s)")


def choose_dataset(value: str, target: str) -> DataChoice:
    """Resolve ``workload.dataset`` for ``target.model`` (ConfigError on a bad value or missing file)."""
    cache = cache_state(target) if value == DATASET_AUTO else None
    if cache is not None and cache.complete:  # read the sidecar once: resolve_dataset would read it again
        path, kind = cache.path, "regenerated"
    else:
        path = resolve_dataset(DATASET_PACKAGED if cache is not None else value, target)
        kind = "packaged" if value in (DATASET_AUTO, DATASET_PACKAGED) or path == _packaged_or_none() else "file"
    return DataChoice(value, target, path, kind, fingerprint(path), cache)


def pin_dataset(cfg: DflashConfig, say: Callable[[str], None] | None = None) -> DflashConfig:
    """``cfg`` with its data file resolved and fingerprinted (module docstring); ``say`` gets the one line
    (default: stdout; pass ``lambda _l: None`` in processes that must stay quiet)."""
    w = cfg.workload
    choice = choose_dataset(w.dataset, cfg.target.model)
    if w.dataset_fingerprint is not None and w.dataset_fingerprint != choice.fingerprint:
        raise ConfigError("workload.dataset", f"{choice.path} has changed since this run was pinned to it "
                          f"(fingerprint {w.dataset_fingerprint} then, {choice.fingerprint} now): its item ids "
                          "no longer name the same conversations; restore the file or start a new run", w.dataset)
    (say or print)(choice.line())
    return with_overrides(cfg, {"workload.dataset": choice.pinned_value,
                                "workload.dataset_fingerprint": choice.fingerprint})


def _packaged_or_none() -> Path | None:
    try:
        return packaged_sharegpt_path()
    except ConfigError:
        return None


def _short(path: Path) -> str:
    home = str(Path.home())
    text = str(path)
    return "~" + text[len(home):] if home != "/" and text.startswith(home + "/") else text

