"""One cache entry built once, however many processes ask for it at the same moment.

A distributed run starts every rank at once, and on a fresh machine each of them finds the
converted tokenizer and model missing. An atomic rename alone is not enough: a rank that looked
for the entry just before another rank renamed it in, then saw a directory "without its marker",
deleted the finished entry while a third rank was reading it (measured: ``dflash train
--nproc-per-node 3`` on a fresh cache failed in the drafter with "Unrecognized model ... should
have a model_type key"). So every build and every deletion happens under an exclusive ``flock`` on
a lock file next to the entry; readers of a complete entry take no lock. Torch-free.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def exclusive(entry: Path) -> Iterator[bool]:
    """Hold the lock of ``entry`` (a directory or a file); yields False (and holds nothing) where the
    cache cannot be written. Also used alone where the entry is one file written atomically, so that
    ranks starting together compute it once instead of each computing it."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(entry.parent / f".{entry.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # closing releases the lock


def load_or_build(entry: Path, is_complete: Callable[[Path], bool], build: Callable[[Path], None],
                  load: Callable[[Path], T]) -> T | None:
    """``load(entry)``, building the entry first (once, under its lock) when it is missing or damaged.

    ``build(tmp)`` writes a whole entry into an empty directory, which is then renamed into place,
    so a reader without the lock sees no entry or a whole one. Returns None when the cache cannot be
    written (a read-only cache, a full disk): the caller then loads from the source directly.
    """
    if is_complete(entry):
        with contextlib.suppress(Exception):  # damaged: rebuilt below, under the lock
            return load(entry)
    with exclusive(entry) as locked:
        if not locked:
            return None
        if is_complete(entry):  # built by another process while we waited, or damaged
            with contextlib.suppress(Exception):
                return load(entry)
        shutil.rmtree(entry, ignore_errors=True)
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        except OSError:
            return None
        try:
            build(tmp)
            os.chmod(tmp, 0o755)
            os.replace(tmp, entry)
        except OSError:
            return None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return load(entry)
