"""Where dflash keeps what it computes once: the one rule for the cache directory.

Converted tokenizers and models, length tables and the target-regenerated data sets all live under
one root, so a user who moves or clears the cache moves or clears all of it. The root is, first set
wins: ``$DFLASH_CACHE_DIR``, ``$DFLASH_CACHE`` (the older name, still honoured),
``$XDG_CACHE_HOME/dflash``, ``~/.cache/dflash``. Torch-free.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = ("DFLASH_CACHE_DIR", "DFLASH_CACHE")


def default_cache_dir() -> Path:
    for name in CACHE_ENV:
        value = os.environ.get(name)
        if value:
            return Path(value).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "dflash"
