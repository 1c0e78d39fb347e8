"""A damaged cache entry is replaced, never deleted first (dflash/data/cache_entry.py).

Ranks read a complete entry without the lock. If the process that finds the entry damaged deleted it
before its rebuild (a model conversion takes ~20 s on two cores), every rank reading it in that time
lost its files half-way and failed ("Unrecognized model ... should have a model_type key"). So the
old entry stays in place until the new one is whole, and a load that only ran out of memory is not
taken for damage.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash.data.cache_entry import load_or_build


def _complete(entry: Path) -> bool:
    return (entry / "done").is_file()


def _read(entry: Path) -> str:
    return (entry / "data").read_text()


def test_a_damaged_entry_stays_readable_until_its_replacement_is_whole(tmp_path: Path) -> None:
    entry = tmp_path / "m"
    entry.mkdir()
    (entry / "done").write_text("ok")
    (entry / "other").write_text("old file a reader is using")  # "data" missing: load raises
    seen_during_build = []

    def build(tmp: Path) -> None:
        seen_during_build.append(sorted(p.name for p in entry.iterdir()))
        (tmp / "data").write_text("new")
        (tmp / "done").write_text("ok")

    assert load_or_build(entry, _complete, build, _read) == "new"
    assert seen_during_build == [["done", "other"]]  # the old entry was still there while building
    assert sorted(p.name for p in entry.iterdir()) == ["data", "done"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock", "m"]  # nothing old or temporary left


def test_running_out_of_memory_while_loading_is_not_damage(tmp_path: Path) -> None:
    entry = tmp_path / "m"
    entry.mkdir()
    (entry / "done").write_text("ok")
    (entry / "data").write_text("fine")
    builds = []

    def no_memory(_: Path) -> str:
        raise MemoryError("cannot allocate")

    with pytest.raises(MemoryError):
        load_or_build(entry, _complete, builds.append, no_memory)
    assert builds == [] and _read(entry) == "fine"
