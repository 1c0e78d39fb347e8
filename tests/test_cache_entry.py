"""Spec: a cache entry is built once however many processes ask for it at once, and a reader never
sees a half-built or deleted entry.

The regression: ``dflash train --nproc-per-node 3`` on a fresh cache failed in a drafter with
"Unrecognized model ... should have a model_type key": a rank deleted the entry another rank had
just renamed into place, while a third was reading it. These tests start real processes at the same
instant (a barrier) against one empty cache directory.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from dflash.data.cache_entry import load_or_build

N_PROCS = 4


def _complete(entry: Path) -> bool:
    return (entry / "done").is_file()


def _slow_build(log: Path):
    def build(tmp: Path) -> None:
        with log.open("a") as f:
            f.write(f"{os.getpid()}\n")
        for i in range(20):  # many files, slowly: a reader of a half-built entry would see it
            (tmp / f"part{i}").write_text(str(i))
            time.sleep(0.01)
        (tmp / "done").write_text("ok")
    return build


def _read(entry: Path) -> list[str]:
    return [(entry / f"part{i}").read_text() for i in range(20)]


def _racer(entry: str, log: str, barrier, out: str) -> None:
    barrier.wait()
    got = load_or_build(Path(entry), _complete, _slow_build(Path(log)), _read)
    Path(out).write_text(json.dumps(got))


def _start_together(target, args: tuple, outs: list[Path], timeout_s: float = 300) -> list:
    """Run ``target(*args, barrier, out)`` in one spawned process per ``out``, released at once by a
    barrier; their JSON results, in order."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(outs))
    procs = [ctx.Process(target=target, args=(*args, barrier, str(o))) for o in outs]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
        assert p.exitcode == 0, f"a racer failed (exit {p.exitcode})"
    return [json.loads(o.read_text()) for o in outs]


def _race(tmp_path: Path, entry: Path) -> list[list[str]]:
    outs = [tmp_path / f"out{i}.json" for i in range(N_PROCS)]
    return _start_together(_racer, (str(entry), str(tmp_path / "builds.log")), outs)


def _builds(tmp_path: Path) -> int:
    log = tmp_path / "builds.log"
    return len(log.read_text().split()) if log.exists() else 0


def test_processes_racing_on_an_empty_cache_build_once_and_all_read_it_whole(tmp_path: Path) -> None:
    entry = tmp_path / "cache" / "models" / "m-123"
    results = _race(tmp_path, entry)
    assert results == [[str(i) for i in range(20)]] * N_PROCS
    assert _builds(tmp_path) == 1
    leftovers = sorted(p.name for p in entry.parent.iterdir() if p.name != entry.name)
    assert leftovers == [".m-123.lock"], leftovers  # no half-built temporary directories


@pytest.mark.parametrize("damage", ["no marker", "marker but unreadable"])
def test_a_partial_or_damaged_entry_is_rebuilt_once(tmp_path: Path, damage: str) -> None:
    entry = tmp_path / "cache" / "m"
    entry.mkdir(parents=True)
    (entry / "part0").write_text("stale")
    if damage == "marker but unreadable":
        (entry / "done").write_text("ok")  # part1..19 missing: load raises
    results = _race(tmp_path, entry)
    assert results == [[str(i) for i in range(20)]] * N_PROCS
    assert _builds(tmp_path) == 1


def test_a_complete_entry_is_read_without_building(tmp_path: Path) -> None:
    entry = tmp_path / "m"
    load_or_build(entry, _complete, _slow_build(tmp_path / "builds.log"), _read)
    assert load_or_build(entry, _complete, _slow_build(tmp_path / "builds.log"), _read) == _read(entry)
    assert _builds(tmp_path) == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through read-only permissions")
def test_a_read_only_cache_returns_none_and_writes_nothing(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert load_or_build(ro / "m", _complete, _slow_build(tmp_path / "builds.log"), _read) is None
        assert list(ro.iterdir()) == [] and _builds(tmp_path) == 0
    finally:
        ro.chmod(0o755)


def test_a_failing_build_leaves_no_entry_and_raises(tmp_path: Path) -> None:
    entry = tmp_path / "m"

    def broken(tmp: Path) -> None:
        (tmp / "part0").write_text("0")
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError, match="conversion failed"):
        load_or_build(entry, _complete, broken, _read)
    assert not entry.exists() and [p.name for p in tmp_path.iterdir()] == [".m.lock"]


def _tokenizer_racer(cache: str, barrier, out: str) -> None:
    from dflash.data.lengths import load_tokenizer

    barrier.wait()
    tok = load_tokenizer("smollm2", cache)
    Path(out).write_text(json.dumps([len(tok), tok.chat_template]))


def test_ranks_converting_the_packaged_tokenizer_at_once_all_get_it(tmp_path: Path) -> None:
    """The real conversion (the packaged GGUF's tokenizer) raced by three processes."""
    cache = tmp_path / "cache"
    got = _start_together(_tokenizer_racer, (str(cache),), [tmp_path / f"tok{i}.json" for i in range(3)])
    assert got[0][0] == 49_152 and "<|im_start|>" in got[0][1]
    assert got == [got[0]] * 3
    entries = [p.name for p in (cache / "tokenizers").iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1, entries


def _lengths_racer(cache: str, barrier, out: str) -> None:
    from dflash.core.config import WorkloadConfig
    from dflash.data.lengths import cached_lengths

    barrier.wait()
    table = cached_lengths(WorkloadConfig(dataset="sharegpt", max_conversations=300), cache_dir=cache,
                           progress=False)
    Path(out).write_text(json.dumps([len(table), table.source["tokenise_s"], table.source["created"]]))


def test_ranks_asking_for_the_same_length_table_at_once_tokenise_once(tmp_path: Path) -> None:
    """Each table carries its own tokenising time: one computation means one time, read by all."""
    got = _start_together(_lengths_racer, (str(tmp_path / "cache"),), [tmp_path / f"len{i}.json" for i in range(3)])
    assert got[0][0] > 200 and got == [got[0]] * 3, got
