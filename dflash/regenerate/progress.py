"""Counts of the run and the progress line: one line on stderr at most every 2 s (records done, failed,
skipped, prompts/s, tokens/s, ETA). Thread-safe, torch-free."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from dflash.regenerate.prompts import Reply

PROGRESS_EVERY_S = 2.0


class Progress:
    """Counts (thread-safe) and a throttled progress line on stderr: at most one per ``every`` seconds."""

    def __init__(self, total: int, stream: TextIO | None = None, every: float = PROGRESS_EVERY_S) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.every = every
        self.lock = threading.Lock()
        self.t0 = time.perf_counter()
        self.last = self.t0
        self.replies = 0
        self.tokens = 0
        self.records = 0
        self.failed = 0
        self.skipped = 0
        self.printed: tuple[int, ...] | None = None

    def reply(self, r: Reply) -> None:
        with self.lock:
            self.replies += 1
            self.tokens += r.tokens or 0

    def finished(self, records: int = 0, failed: int = 0, skipped: int = 0) -> None:
        with self.lock:
            self.records += records
            self.failed += failed
            self.skipped += skipped

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def rates(self) -> tuple[float, float]:
        """(prompts/s, tokens/s) since generation started; a prompt is one generated reply."""
        dt = max(self.elapsed, 1e-9)
        return self.replies / dt, self.tokens / dt

    def line(self) -> str:
        pps, tps = self.rates()
        handled = self.records + self.failed + self.skipped
        left = self.total - handled
        eta = f", eta {_fmt_s(left * self.elapsed / handled)}" if handled and left > 0 else ""
        return (f"regenerate: {handled}/{self.total} records ({self.records} written, {self.failed} failed, "
                f"{self.skipped} skipped) | {pps:.2f} prompts/s, {tps:.1f} tokens/s{eta}")

    def maybe_print(self, force: bool = False) -> None:
        """The progress line, at most every ``every`` seconds (``force``: now, unless nothing changed)."""
        now = time.perf_counter()
        if force or now - self.last >= self.every:
            self.last = now
            state = (self.records, self.failed, self.skipped, self.replies)
            if force and state == self.printed:
                return
            self.printed = state
            print(self.line(), file=self.stream, flush=True)


def _fmt_s(s: float) -> str:
    s = round(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
