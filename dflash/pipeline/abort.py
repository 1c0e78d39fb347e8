"""The abort path: a rank's first failure, from any of its threads, ends the rank within seconds, and its
peers follow within seconds, instead of waiting out ``wait_s``/``pg_timeout_s`` (600 s by default).

Why: a thread that dies on an exception nobody expected must never leave its owner waiting, and one
failed rank must not leave the others waiting for it. Three pieces, one per way a failure can hide:

- **In a rank** (:data:`FAILURE`): every thread of a rank (the producer's reader and sender, the
  coordinator, the status writer, the NVML telemetry sampler, the heartbeat) hands any
  ``BaseException`` to :meth:`RankFailure.fail`. The thread's owner raises it where it waits (the
  producer's reply queue, the coordinator's error); where the owner cannot see it (blocked in a
  collective or a forward) a watchdog reports it as the rank's failure (its traceback file and one
  line) and leaves after :data:`ABORT_GRACE_S`; for a thread nobody waits on (the status writer, the
  telemetry sampler, the heartbeat) it does so at once.
- **Between ranks**: a failing rank tells the coordinator (:class:`~dflash.pipeline.messages.Failed`,
  best effort, before it exits); the coordinator then fails with that cause, closes every control
  channel, and every rank's reader or wait sees the closed channel at once. A rank that dies silently
  (a killed host, a cut network: no closed socket reaches the coordinator) is noticed by its missing
  heartbeat (:class:`Heartbeat`, every :data:`HEARTBEAT_S`; silent for ``DFLASH_HEARTBEAT_S``,
  default :data:`HEARTBEAT_TIMEOUT_S`, it is dead) with the same effect.
- **From the launcher** (:class:`AbortOnPeerFailure`): torch's elastic agent stops the other ranks of a
  failed job with SIGTERM and kills them only 30 s later. A SIGTERM normally asks a rank to stop after
  its step with a checkpoint; when a peer has already failed (its ``rank-N.error`` file exists) there
  is nothing to checkpoint with, so the rank leaves at once. A thread reading the signal wakeup fd sees
  the signal even while the main thread is blocked in C++ (a gloo wait), where a Python handler never
  runs.

What a leaving rank must write is already written: the ledger and the records are flushed at every
line, and ``--resume`` cuts both back to the last verified checkpoint, so each item is trained once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

RANKS_DIR = ".ranks"  # RUN/.ranks/: each rank's status, error and traceback files
LOST_PEER_GRACE_S = 2.0  # how long a failure waits to learn whether a vanished rank caused it (see left_a_reason)
ABORT_GRACE_S = 3.0  # the owner's time to raise a thread's failure itself before the watchdog leaves for it
HEARTBEAT_S = 1.0  # each rank's beat to the coordinator
HEARTBEAT_ENV = "DFLASH_HEARTBEAT_S"
HEARTBEAT_TIMEOUT_S = 30.0  # a rank silent this long is dead (generous: a loaded host delays a beat by seconds)


def heartbeat_timeout_s() -> float:
    """How long the coordinator lets a rank be silent (``DFLASH_HEARTBEAT_S``, default 30 s)."""
    raw = os.environ.get(HEARTBEAT_ENV, "")
    try:
        value = float(raw) if raw else HEARTBEAT_TIMEOUT_S
    except ValueError:
        value = -1.0
    if not value > 2 * HEARTBEAT_S:
        raise ValueError(f"{HEARTBEAT_ENV}: {raw!r} is not a number of seconds above {2 * HEARTBEAT_S:g}")
    return value


class RankFailure:
    """A rank's first failure from any thread, and who reports it: the owner or, after a grace, the watchdog.

    One per process (a rank is a process): :data:`FAILURE`. ``exit_with`` is installed by the rank's entry
    (dflash.pipeline.rank.rank_main): it writes the rank's error and traceback files and ends the process.
    """

    def __init__(self, grace_s: float = ABORT_GRACE_S) -> None:
        self.grace_s = grace_s
        self.error: BaseException | None = None
        self.where: str | None = None
        self.t: float | None = None
        self._lock = threading.Lock()
        self._claimed = False
        self._exit_with: Callable[[BaseException], Any] | None = None

    def install(self, exit_with: Callable[[BaseException], Any]) -> None:
        self._exit_with = exit_with

    def fail(self, exc: BaseException, where: str, *, owner_raises: bool = True) -> None:
        """``where`` (a thread) failed with ``exc``; the first failure is the rank's. Never raises.

        ``owner_raises``: the thread's owner is told too (a reply queue) and gets :attr:`grace_s` to raise it
        itself; else (a thread nobody waits on) the rank reports it at once."""
        with self._lock:
            if self.error is not None:
                return
            self.error, self.where, self.t = exc, where, time.time()
        if self._exit_with is not None:
            grace = self.grace_s if owner_raises else 0.0
            threading.Thread(target=self._watch, args=(grace,), name="abort-watchdog", daemon=True).start()

    def claim(self) -> bool:
        """True for the first caller only: that one reports the failure and ends the process."""
        with self._lock:
            first, self._claimed = not self._claimed, True
            return first

    def _watch(self, grace_s: float) -> None:
        time.sleep(grace_s)
        if self.error is not None and self._exit_with is not None and self.claim():
            self._exit_with(self.error)


FAILURE = RankFailure()


@contextlib.contextmanager
def handed_off(where: str, also: Callable[[BaseException], None] | None = None) -> Iterator[None]:
    """Run a thread's body so that any exception it ends on goes to its owner: ``also`` (the owner's own
    queue, when it has one) and :data:`FAILURE` (the rank's watchdog; at once where nobody waits on the thread)."""
    try:
        yield
    except BaseException as exc:
        if also is not None:
            also(exc)
        FAILURE.fail(exc, where, owner_raises=also is not None)


class Heartbeat:
    """A rank's beat to the coordinator over its control channel, every :data:`HEARTBEAT_S`.

    Its silence is how the coordinator tells a dead rank (whose socket never closed) from a slow one. A
    closed channel ends the beat quietly: losing the coordinator is the rank's reader's or wait's to
    report; anything else is the rank's failure (:func:`handed_off`).
    """

    def __init__(self, send: Callable[[], None], interval_s: float = HEARTBEAT_S) -> None:
        self._send, self.interval_s = send, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        from dflash.pipeline.channel import ChannelError
        from dflash.pipeline.faults import fault

        with handed_off("heartbeat"):
            while not self._stop.wait(self.interval_s):
                fault("heartbeat.beat")
                try:
                    self._send()
                except ChannelError:
                    return


def left_a_reason(out: Path, rank: int) -> bool:
    """Whether ``rank`` failed or left with its own line (its ``.error`` file): a rank whose channel closes
    without one vanished (killed, its node lost), and that is the cause of whatever failed around it."""
    return (Path(out) / RANKS_DIR / f"rank-{rank}.error").exists()


class AbortOnPeerFailure:
    """On SIGTERM/SIGINT: when a peer rank already failed, leave now (``leave(line)``); else the normal
    clean stop (the rank's own handler, which stops after its step with a checkpoint).

    Reads the signal wakeup fd in a thread, so it acts while the main thread is blocked in C++.
    Installed from the main thread only; a no-op elsewhere.
    """

    def __init__(self, ranks_dir: Path, rank: int, leave: Callable[[str], Any]) -> None:
        self.ranks_dir, self.rank, self.leave = Path(ranks_dir), rank, leave
        self._r: int | None = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            os.close(r)
            os.close(w)
            return
        self._r = r
        threading.Thread(target=self._loop, name="abort-on-peer-failure", daemon=True).start()

    def failed_peer(self) -> str | None:
        """The first other rank's error file, if any rank but this one has failed."""
        for f in sorted(self.ranks_dir.glob("rank-*.error")):
            if f.name != f"rank-{self.rank}.error":
                return f.stem
        return None

    def _loop(self) -> None:
        assert self._r is not None
        while True:
            try:
                data = os.read(self._r, 64)
            except OSError:
                return
            if not data:
                return
            if any(b in (signal.SIGTERM, signal.SIGINT) for b in data):
                peer = self.failed_peer()
                if peer is not None:
                    self.leave(f"stopped because {peer.replace('-', ' ')} failed")
                    return
