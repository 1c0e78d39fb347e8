"""The output files: whole-line, fsynced appends to ``DATA.jsonl``, the failed-prompt log beside it, and
what an earlier run left there (ids done, a torn last line, its sidecar).

Why whole lines: each record is one ``os.write`` of one complete line on an ``O_APPEND`` file,
followed by ``fsync`` once per batch of finished records, so a kill at any moment leaves whole
records; a trailing partial line (a write torn by a crash) is cut off on the next start. Text is
written with ``ensure_ascii=False`` except for the characters ``str.splitlines`` treats as line
breaks (U+0085, U+2028, U+2029), which stay escaped so a reader that splits lines that way never
cuts a record in two. Torch-free.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.core.errors import ConfigError
from dflash.data.regenerated_cache import FORMAT, failed_path, sidecar_path

__all__ = ["FORMAT", "Emit", "Existing", "Failure", "Output", "error_text", "failed_path", "inspect_output", "now_iso",
           "record_line", "sidecar_path"]
# json.dumps(ensure_ascii=False) leaves these raw, and str.splitlines() (data.conversations) breaks lines at them.
_LINE_BREAKS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


@dataclass(frozen=True)
class Failure:
    """A prompt that got no reply this run: logged beside the output, retried by the next run."""

    id: str
    error: str
    attempts: int = 1


# A back end hands what finished (records, failures) to this; the run writes them and the sidecar.
Emit = Callable[[list[dict[str, Any]], list[Failure]], None]


def record_line(record: dict[str, Any]) -> bytes:
    """One record as one line of UTF-8 (no raw character that any line splitter breaks at)."""
    text = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
    for ch, esc in _LINE_BREAKS.items():
        text = text.replace(ch, esc)
    return (text + "\n").encode("utf-8")


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def error_text(exc: BaseException) -> str:
    """An exception as one short line for the failed-prompt log."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:500]


# --------------------------------------------------------------------------- what is there already
@dataclass
class Existing:
    """What an earlier run left at ``--out``: ids done, the sidecar, and a torn tail to cut off."""

    done_ids: set[str] = field(default_factory=set)
    records: int = 0
    sidecar: dict[str, Any] | None = None
    keep_bytes: int = 0  # bytes of whole lines
    torn_bytes: int = 0  # bytes of a trailing partial line


def inspect_output(out: Path) -> Existing:
    """Read (never write) the output and its sidecar; a file we did not write is refused (ConfigError)."""
    ex = Existing(sidecar=_read_sidecar(out))
    data = out.read_bytes() if out.is_file() else b""
    if not data:  # nothing generated yet (or the data was deleted): a fresh start, whatever the sidecar said
        ex.sidecar = None
        return ex
    if ex.sidecar is None:
        raise ConfigError("--out", f"exists but has no sidecar {sidecar_path(out).name}: not a dflash regenerate "
                          "output, refusing to append to it", str(out))
    cut = data.rfind(b"\n") + 1
    ex.keep_bytes, ex.torn_bytes = cut, len(data) - cut
    for n, raw in enumerate(data[:cut].split(b"\n")[:-1], start=1):
        if raw.strip():
            ex.done_ids.add(_record_id(raw, n, out))
            ex.records += 1
    return ex


def _read_sidecar(out: Path) -> dict[str, Any] | None:
    side = sidecar_path(out)
    if not side.is_file():
        return None
    try:
        meta = json.loads(side.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError("--out", f"its sidecar {side.name} is unreadable ({exc}); move it away or use "
                          "another --out", str(out)) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("settings"), dict):
        raise ConfigError("--out", f"its sidecar {side.name} was not written by dflash regenerate ({FORMAT})",
                          str(out))
    return meta


def _record_id(raw: bytes, n: int, out: Path) -> str:
    try:
        rec = json.loads(raw)
    except ValueError:
        rec = None
    if not isinstance(rec, dict) or not isinstance(rec.get("id"), str) or not isinstance(rec.get("conversations"),
                                                                                         list):
        raise ConfigError("--out", f"line {n} is not a dflash regenerate record; refusing to append", str(out))
    return rec["id"]


# --------------------------------------------------------------------------- appending
class Output:
    """Appends whole records to ``--out`` (one write per line, fsync per batch) and failures beside it."""

    def __init__(self, out: Path, existing: Existing) -> None:
        self.path = out
        out.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if existing.torn_bytes:
            # A line torn by a crash: cut back to the last whole record before appending.
            os.ftruncate(self.fd, existing.keep_bytes)
            os.fsync(self.fd)
        self.failed_fd: int | None = None
        self.written = 0

    def write(self, records: Sequence[dict[str, Any]]) -> None:
        if not records:
            return
        for rec in records:
            _write_all(self.fd, record_line(rec))
        os.fsync(self.fd)
        self.written += len(records)

    def log_failures(self, failures: Sequence[Failure]) -> None:
        if not failures:
            return
        if self.failed_fd is None:
            self.failed_fd = os.open(failed_path(self.path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        t = now_iso()
        for f in failures:
            _write_all(self.failed_fd, record_line({"id": f.id, "error": f.error, "attempts": f.attempts, "t": t}))
        os.fsync(self.failed_fd)

    def close(self) -> None:
        for fd in (self.fd, self.failed_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.failed_fd = None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
