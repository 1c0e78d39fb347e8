"""The thread-safe hidden-state queue the trainer's target and drafter threads share.

All decisions are :class:`dflash.core.queue_core.QueueCore`'s; this class only adds a lock, two condition
variables, a clock (injectable, so a test can drive it with a fake one) and the take log. Keeping
synchronisation and policy apart is what lets the simulator reuse the decisions unchanged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dflash.core.config import QueueConfig
from dflash.core.queue_core import QueueCore, QueueItem


class QueueTimeout(TimeoutError):
    """A put or take waited longer than its timeout (tests use this to turn a deadlock into a failure)."""


@dataclass(frozen=True, slots=True)
class TakeLogEntry:
    """One take, as DESIGN.md's ``take`` record (plus the gate reason)."""

    t: float
    drafter: int
    step: int | None
    item_ids: tuple[str, ...]
    bucket: int
    wait_s: float
    depth_before: int
    bucket_depths: tuple[int, ...]
    gate: str

    def as_record(self) -> dict[str, Any]:
        return {"kind": "take", "t": self.t, "drafter": self.drafter, "step": self.step,
                "item_ids": list(self.item_ids), "bucket": self.bucket, "wait_s": self.wait_s,
                "depth_before": self.depth_before, "bucket_depths": list(self.bucket_depths),
                "gate": self.gate}


class HSQueue:
    """Producers ``put`` (blocking at the cap), drafters ``take`` (blocking at the gate).

    ``close()`` says producers are done (drain until empty); ``stop()`` ends the run at once: what is
    queued, and what blocked producers hold, is discarded and counted in ``discarded_at_stop``.
    """

    def __init__(self, config: QueueConfig, n_buckets: int, *, mix: Sequence[float] | None = None,
                 seed: int = 0, clock: Callable[[], float] = time.monotonic,
                 log_takes: bool = True) -> None:
        self._core = QueueCore(config, n_buckets, mix=mix, seed=seed)
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)  # producers wait here for the cap
        self._ready = threading.Condition(self._lock)  # drafters wait here for the gate
        self._clock = clock
        self._t0 = clock()
        self._log_takes = log_takes
        self._take_log: list[tuple[Any, ...]] = []
        self._stopped = False
        self._waiting_producers = 0
        self._waiting_drafters = 0
        self.producer_blocked_s = 0.0
        self.drafter_wait_s = 0.0
        self.in_flight = 0  # taken, not yet reported trained
        self._refused_at_stop = 0  # items finished by producers after stop(): produced, never queued

    # ---------------------------------------------------------------- time
    def now(self) -> float:
        """Seconds since the queue was made, on the queue's clock."""
        return self._clock() - self._t0

    def continue_clock_from(self, t: float) -> None:
        """A resumed run's queue: ``now()`` continues from ``t`` (the checkpoint's time)."""
        self._t0 = self._clock() - t

    # ---------------------------------------------------------------- producers
    def put(self, item: QueueItem, worker: int = 0, timeout: float | None = None) -> float | None:
        """Enqueue after blocking while the cap is reached; returns seconds blocked.

        Returns None if the run was stopped: the item is then counted as discarded, not queued.
        """
        core = self._core
        with self._lock:
            t0 = self._clock() - self._t0
            if not self._stopped and not core.blocked and core.try_put(item, t0):
                if self._waiting_drafters and core.gate() is not None:  # _notify_drafters, inlined: hot path
                    self._ready.notify()
                return 0.0
            if not self._stopped and not core.admissible(worker, item):
                self._wait_for_space(core, item, worker, timeout)
            if self._stopped:
                core.counters.discarded_at_stop += 1
                self._refused_at_stop += 1
                return None
            t1 = self._clock() - self._t0
            blocked = t1 - t0
            self.producer_blocked_s += blocked
            core.put(item, t1)
            self._notify_drafters()
            if self._waiting_producers:  # the next blocked producer in index order may fit now
                self._space.notify_all()
            return blocked

    def _wait_for_space(self, core: QueueCore, item: QueueItem, worker: int,
                        timeout: float | None) -> None:
        core.block(worker, item.nbytes)
        self._notify_drafters()  # the gate opens while a producer is blocked at the cap
        deadline = None if timeout is None else time.monotonic() + timeout
        self._waiting_producers += 1
        try:
            while not self._stopped and not core.admissible(worker, item):
                if not self._space.wait(self._remaining(deadline)) and self._expired(deadline):
                    raise QueueTimeout(f"producer {worker} blocked at the cap for {timeout} s")
        finally:
            self._waiting_producers -= 1
            core.unblock(worker)

    def close(self) -> None:
        """Producers are done; drafters drain what is queued, then ``take`` returns None."""
        with self._lock:
            self._core.close()
            self._ready.notify_all()

    # ---------------------------------------------------------------- drafters
    def take(self, drafter: int = 0, step: int | None = None,
             timeout: float | None = None) -> list[QueueItem] | None:
        """Block until the gate allows, then take from the bucket the policy picks.

        Returns None when the run is over: stopped, or closed and drained.
        """
        core = self._core
        with self._lock:
            t0 = self._clock() - self._t0
            reason = core.gate()
            if reason is None:
                reason = self._wait_for_gate(core, drafter, timeout)
                if reason is None:
                    return None
                t1 = self._clock() - self._t0
            else:
                t1 = t0
            depth_before = core.depth
            bucket_depths = tuple(core.counts) if self._log_takes else ()
            bucket, items = core.take(t1)
            wait = t1 - t0
            self.drafter_wait_s += wait
            self.in_flight += len(items)
            if self._log_takes:
                # A flat tuple of atoms (no list, no object): the cyclic GC untracks it, so a long
                # take log costs no collection time. The record object is built when read.
                ids = (items[0].item_id,) if len(items) == 1 else tuple(i.item_id for i in items)
                self._take_log.append((t1, drafter, step, ids, bucket, wait, depth_before,
                                       bucket_depths, reason))
            if self._waiting_producers:
                self._space.notify_all()
            self._notify_drafters()  # another drafter may take at once if the gate is still open
            return items

    def _wait_for_gate(self, core: QueueCore, drafter: int, timeout: float | None) -> str | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        self._waiting_drafters += 1
        try:
            while True:
                if self._stopped or (core.closed and core.depth == 0):
                    return None
                if not self._ready.wait(self._remaining(deadline)) and self._expired(deadline):
                    raise QueueTimeout(f"drafter {drafter} waited at the gate for {timeout} s")
                if self._stopped:
                    return None
                reason = core.gate()
                if reason is not None:
                    return reason
        finally:
            self._waiting_drafters -= 1

    def task_done(self, items: Sequence[QueueItem]) -> None:
        """A drafter finished training on taken items (they count as trained)."""
        with self._lock:
            self.in_flight -= len(items)
            self._core.counters.trained += len(items)

    # ---------------------------------------------------------------- stopping, re-tuning
    def stop(self) -> list[QueueItem]:
        """End the run now: discard queued items (counted) and wake every waiter."""
        with self._lock:
            self._stopped = True
            discarded = self._core.discard_all()
            self._space.notify_all()
            self._ready.notify_all()
            return discarded

    def reconfigure(self, config: QueueConfig) -> None:
        """Apply new knobs atomically between takes; waiters re-check the new gate and cap."""
        with self._lock:
            self._core.reconfigure(config)
            self._space.notify_all()
            self._ready.notify_all()

    # ---------------------------------------------------------------- observability
    @property
    def config(self) -> QueueConfig:
        return self._core.config

    def qsize(self) -> int:
        with self._lock:
            return self._core.depth

    def bucket_sizes(self) -> list[int]:
        with self._lock:
            return list(self._core.counts)

    def queued_bytes(self) -> int:
        with self._lock:
            return self._core.queued_bytes

    def take_log(self) -> list[TakeLogEntry]:
        with self._lock:
            return [_entry(raw) for raw in self._take_log]

    def drain_take_log(self) -> list[TakeLogEntry]:
        """Hand over and forget the take log so far (the trainer appends it to its JSONL records)."""
        with self._lock:
            log, self._take_log = self._take_log, []
        return [_entry(raw) for raw in log]

    def stats(self) -> dict[str, Any]:
        """Counters for the summary record.

        Invariant: ``produced == trained + in_flight + queued + discarded_at_stop``; after a stop
        with every drafter finished, ``queued == in_flight == 0`` and DESIGN.md's identity holds.
        """
        with self._lock:
            c = self._core.counters
            produced = sum(c.produced) + self._refused_at_stop
            return {
                "produced": produced,
                "queued": self._core.depth,
                "taken": sum(c.taken),
                "takes": c.takes,
                "trained": c.trained,
                "in_flight": self.in_flight,
                "discarded_at_stop": c.discarded_at_stop,
                "produced_per_bucket": list(c.produced),
                "taken_per_bucket": list(c.taken),
                "max_depth_seen": c.max_depth_seen,
                "peak_queued_bytes": c.peak_queued_bytes,
                "queued_bytes": self._core.queued_bytes,
                "blocked_producers": len(self._core.blocked),
                "producer_blocked_s": self.producer_blocked_s,
                "drafter_wait_s": self.drafter_wait_s,
                "max_item_age_s": list(c.per_bucket_max_age_s),
            }

    # ---------------------------------------------------------------- internals
    def _notify_drafters(self) -> None:
        if self._waiting_drafters and self._core.gate() is not None:
            self._ready.notify()

    @staticmethod
    def _remaining(deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    @staticmethod
    def _expired(deadline: float | None) -> bool:
        return deadline is not None and time.monotonic() >= deadline


def _entry(raw: tuple[Any, ...]) -> TakeLogEntry:
    return TakeLogEntry(*raw)
