"""The distributed queue's decisions: which producer may put, which drafter gets which item, in which round.

:class:`Coordinator` wraps the one :class:`dflash.core.queue_core.QueueCore` (the gate, cap, policy and
same-instant order of docs/ARCHITECTURE.md, unchanged) for a job of many ranks. Producers report an item
*ready* (its id, bucket, shapes, bytes: never the tensor); the item is put at once if it fits, else
its producer is blocked at the cap until a take frees room. Drafters *request* work; :meth:`serve`
answers waiting requests in drafter-index order, each take re-checking the gate, and numbers every
transfer with a global round so that each rank can run its part of the rounds in increasing order
(crossed producer/drafter pairs cannot deadlock: the smallest unfinished round always has both of
its ranks waiting on it).

Like ``queue_core``: no threads, no sockets, no clock. The caller (:mod:`dflash.pipeline.service`)
passes the time in, applies every put of an instant before calling :meth:`serve` (puts before takes)
and carries the returned actions to the ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dflash.core.autopilot import Autopilot, QueueState
from dflash.core.config import QueueConfig
from dflash.core.queue_core import QueueCore, QueueItem

SYNC_STEP = "step"  # synchronised drafters: within a step, takes go in drafter-index order


@dataclass(frozen=True, slots=True)
class Transfer:
    """One item moving producer -> drafter in global round ``round``; shapes travel here, tensors do not."""

    round: int
    item_id: str
    producer: int
    drafter: int
    meta: Any  # what the producer reported: shapes, dtypes, checksum


@dataclass(frozen=True, slots=True)
class Assignment:
    """A take granted to one drafter: the take record's fields and the item transfers."""

    drafter: int
    step: int | None
    t: float
    bucket: int
    gate: str
    wait_s: float
    depth_before: int
    bucket_depths: tuple[int, ...]
    items: tuple[QueueItem, ...]
    transfers: tuple[Transfer, ...]


@dataclass(frozen=True, slots=True)
class Admit:
    """A producer blocked at the cap was admitted: its item is queued, it may compute the next one."""

    producer: int
    item_id: str
    t: float
    blocked_s: float


@dataclass(frozen=True, slots=True)
class NoWork:
    """A drafter's request ends with nothing: the queue is drained (or the run stopped)."""

    drafter: int
    step: int | None


Action = Assignment | Admit | NoWork


@dataclass
class _Blocked:
    item: QueueItem
    t: float


@dataclass
class _Request:
    step: int | None
    t: float


@dataclass
class Coordinator:
    """Pure decisions of the distributed queue (not thread-safe: the caller serialises access).

    ``start_config`` is the knobs the run starts with; the knobs *in force* are :attr:`config`, which
    reads them from the one :class:`QueueCore` that decides with them. A live change (``tune-live``) and
    an autopilot decision both go through :meth:`reconfigure`, so there is no second copy to keep in step:
    the service, its checkpoints, the run's metrics and its summary all read :attr:`config`."""

    start_config: QueueConfig
    n_buckets: int
    n_producers: int
    n_drafters: int
    mix: Sequence[float] | None = None
    seed: int = 0
    sync: str = SYNC_STEP
    core: QueueCore = field(init=False)
    round: int = 0
    stopped: bool = False
    closed_producers: set[int] = field(default_factory=set)
    blocked: dict[int, _Blocked] = field(default_factory=dict)
    waiting: dict[int, _Request] = field(default_factory=dict)
    served_in_step: dict[int | None, set[int]] = field(default_factory=dict)
    owner: dict[str, int] = field(default_factory=dict)  # queued or blocked item id -> producer
    resident: list[int] = field(default_factory=list)  # bytes each producer holds, not yet assigned
    # [queue] mode = "auto": the queue autopilot (dflash.core.autopilot, the simulator's own code) sees every
    # put and take and may change the knobs between takes; its decisions wait in ``controls`` for the caller
    autopilot: Autopilot | None = None
    controls: list[dict[str, Any]] = field(default_factory=list)
    history: list[tuple[float, QueueConfig]] = field(default_factory=list)  # (from time, knobs): every change

    def __post_init__(self) -> None:
        self.core = QueueCore(self.start_config, self.n_buckets, mix=self.mix, seed=self.seed)
        self.history = [(0.0, self.start_config)]
        self.resident = [0] * self.n_producers

    # ---------------------------------------------------------------- producers
    def ready(self, producer: int, item: QueueItem, t: float) -> bool:
        """A computed item: put now if admissible (True), else block its producer at the cap (False)."""
        if self.stopped:
            raise RuntimeError("ready after stop")
        self.owner[item.item_id] = producer
        self.resident[producer] += item.nbytes
        if self.core.admissible(producer, item):
            self.core.put(item, t)
            if self.autopilot is not None:
                self.autopilot.observe_put(t, item.bucket, item.nbytes, 0.0)
            return True
        self.core.block(producer, item.nbytes)
        self.blocked[producer] = _Blocked(item, t)
        return False

    def producer_closed(self, producer: int) -> None:
        """A producer has no more items; when every producer has closed, the gate opens for draining."""
        self.closed_producers.add(producer)
        if len(self.closed_producers) == self.n_producers and not self.blocked:
            self.core.close()

    # ---------------------------------------------------------------- drafters
    def request(self, drafter: int, step: int | None, t: float) -> None:
        """A drafter asks for its take of ``step``; :meth:`serve` answers it."""
        if drafter in self.waiting:
            raise RuntimeError(f"drafter {drafter} asked twice without an answer")
        self.waiting[drafter] = _Request(step, t)

    def serve(self, t: float) -> list[Action]:
        """Every decision possible at time ``t``: admit blocked producers, then takes in drafter order."""
        actions: list[Action] = self._admit_blocked(t)
        for d in sorted(self.waiting):
            req = self.waiting[d]
            if self.sync == SYNC_STEP and not self._turn(d, req.step):
                break  # a lower-index drafter has not taken for this step yet
            if self.stopped or (self.core.closed and self.core.depth == 0):
                del self.waiting[d]
                self._served(d, req.step)
                actions.append(NoWork(d, req.step))
                continue
            reason = self.core.gate()
            if reason is None:
                break  # the gate is shut for everyone at this instant
            del self.waiting[d]
            self._served(d, req.step)
            actions.append(self._take(d, req, reason, t))
            actions.extend(self._admit_blocked(t))
        return actions

    def _take(self, d: int, req: _Request, reason: str, t: float) -> Assignment:
        core = self.core
        depth_before, bucket_depths = core.depth, tuple(core.counts)
        bucket, items = core.take(t)
        transfers = []
        for item in items:
            producer = self.owner.pop(item.item_id)
            self.resident[producer] -= item.nbytes
            self.round += 1
            transfers.append(Transfer(self.round, item.item_id, producer, d, item.payload))
        if self.autopilot is not None:
            self._steer(t, bucket, len(items), t - req.t)
        return Assignment(d, req.step, t, bucket, reason, t - req.t, depth_before, bucket_depths, tuple(items),
                          tuple(transfers))

    def _admit_blocked(self, t: float) -> list[Action]:
        """Blocked producers enter in index order while they fit (docs/ARCHITECTURE.md: among producers by index)."""
        out: list[Action] = []
        progress = True
        while progress and not self.stopped:
            progress = False
            for w in sorted(self.blocked):
                b = self.blocked[w]
                if self.core.admissible(w, b.item):
                    del self.blocked[w]
                    self.core.unblock(w)
                    self.core.put(b.item, t)
                    if self.autopilot is not None:
                        self.autopilot.observe_put(t, b.item.bucket, b.item.nbytes, t - b.t)
                    out.append(Admit(w, b.item.item_id, t, t - b.t))
                    progress = True
                    break
        if len(self.closed_producers) == self.n_producers and not self.blocked:
            self.core.close()
        return out

    def _turn(self, d: int, step: int | None) -> bool:
        served = self.served_in_step.get(step, set())
        return all(lower in served for lower in range(d))

    def _served(self, d: int, step: int | None) -> None:
        if self.sync != SYNC_STEP:
            return
        served = self.served_in_step.setdefault(step, set())
        served.add(d)
        if len(served) == self.n_drafters:
            del self.served_in_step[step]

    def _steer(self, t: float, bucket: int, n_items: int, wait_s: float) -> None:
        """The autopilot sees the take; a decision applies before the next take (as in the simulator)."""
        assert self.autopilot is not None
        self.autopilot.observe_take(t, bucket, n_items, wait_s)
        decision = self.autopilot.decide(t, QueueState(self.core.depth, self.core.queued_bytes, len(self.blocked)))
        if decision is not None:
            self.reconfigure(decision.config, t)
            self.controls.append(decision.record())

    # ---------------------------------------------------------------- stopping and re-tuning
    @property
    def config(self) -> QueueConfig:
        """The queue's knobs in force (their one home: the core decides with them)."""
        return self.core.config

    def reconfigure(self, config: QueueConfig, t: float) -> None:
        """New knobs in force from time ``t`` on (between takes)."""
        self.core.reconfigure(config)
        self.history.append((t, config))

    def min_ready_schedule(self) -> list[tuple[float, int]]:
        """(from time, min_ready) of this session: what the run's steady-state span is judged by."""
        return [(t, c.min_ready) for t, c in self.history]

    def stop(self) -> tuple[list[QueueItem], list[Action]]:
        """End the run: queued and blocked items are discarded (returned), waiting drafters get NoWork."""
        discarded = self.core.discard_all()
        for w in sorted(self.blocked):
            discarded.append(self.blocked.pop(w).item)
            self.core.unblock(w)
            self.core.counters.discarded_at_stop += 1
        for item in discarded:
            producer = self.owner.pop(item.item_id, None)
            if producer is not None:
                self.resident[producer] -= item.nbytes
        self.stopped = True
        actions: list[Action] = [NoWork(d, self.waiting[d].step) for d in sorted(self.waiting)]
        self.waiting.clear()
        return discarded, actions

    def state(self) -> dict[str, Any]:
        return {"depth": self.core.depth, "bucket_depths": list(self.core.counts),
                "queued_bytes": self.core.queued_bytes, "blocked_producers": sorted(self.blocked),
                "resident_bytes_per_producer": list(self.resident), "round": self.round}
