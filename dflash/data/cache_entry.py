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
    so a reader without the lock sees no entry or a whole one. A damaged entry stays where it is
    until its replacement is whole (:func:`_swap_in`): lock-free readers of it are not cut off for
    the length of a build. A load that runs out of memory says nothing about the entry: it is
    raised, never taken for damage. Returns None when the cache cannot be written (a read-only
    cache, a full disk): the caller then loads from the source directly.
    """
    if is_complete(entry):
        try:
            return load(entry)
        except MemoryError:
            raise
        except Exception:  # damaged: rebuilt below, under the lock
            pass
    with exclusive(entry) as locked:
        if not locked:
            return None
        if is_complete(entry):  # built by another process while we waited, or damaged
            try:
                return load(entry)
            except MemoryError:
                raise
            except Exception:  # damaged: replaced below
                pass
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        except OSError:
            return None
        try:
            build(tmp)
            os.chmod(tmp, 0o755)
            _swap_in(tmp, entry)
        except OSError:
            return None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return load(entry)


def _swap_in(tmp: Path, entry: Path) -> None:
    """Put the whole new entry ``tmp`` at ``entry``: two renames, then the old entry is deleted. (A
    directory cannot be renamed over a non-empty one, and deleting the old entry first, before a
    minutes-long build, cut off the ranks that were reading it: "Unrecognized model ... should have
    a model_type key" from a drafter rank while a target rank rebuilt the conversion.)"""
    if not (entry.exists() or entry.is_symlink()):
        os.replace(tmp, entry)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{entry.name}.old.", dir=entry.parent))
    os.replace(entry, old / entry.name)
    os.replace(tmp, entry)
    shutil.rmtree(old, ignore_errors=True)
