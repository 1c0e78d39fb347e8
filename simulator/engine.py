"""The SimPy model of the target/drafter pipeline around the trainer's own queue core.

:class:`SimHSQueue` is a SimPy resource in the way SimPy's own stores are: it overrides
``_do_put``/``_do_get`` (and the triggers that call them), and delegates every decision, cap, gate,
policy, oldest-first, to :class:`dflash.core.queue_core.QueueCore`, the object the threaded trainer queue
wraps. Only compute time is simulated.

Same-instant order (docs/ARCHITECTURE.md): puts before takes; among producers and among drafters, by worker
index. SimPy processes events of one instant in scheduling order, so the resource defers its
decisions: pending puts are settled by an event at priority ``PUT_PRIORITY`` and pending takes at
``TAKE_PRIORITY``, both after every ordinary event of that instant. Requests wait in lists sorted
by worker index. After each take, producers blocked at the cap are admitted (their puts happen at
that instant) before the next drafter's take re-checks the gate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterator
from heapq import heappush
from typing import Any

import simpy
from simpy.core import BoundClass
from simpy.events import NORMAL, Event, Timeout
from simpy.resources.base import BaseResource, Get, Put

from dflash.core.queue_core import QueueCore, QueueItem

PUT_PRIORITY = 2  # SimPy's own priorities are 0 (urgent) and 1 (normal)
TAKE_PRIORITY = 3


class QueuePut(Put):
    """A producer's request to enqueue ``item``; its value is the seconds it was blocked."""

    def __init__(self, resource: SimHSQueue, item: QueueItem, worker: int) -> None:
        # Put.__init__ and Event.__init__ written out (a blocked put per item in a drafter-bound run)
        env = resource._env
        self.env = env
        self.callbacks = [resource._trigger_get]
        self.resource = resource
        self.proc = env.active_process
        self.item = item
        self.index = worker
        self.t_request = env.now
        resource.put_queue.append(self)
        resource._trigger_put(None)


class QueueGet(Get):
    """A drafter's request to take; its value is the list of items, or None when drained."""

    def __init__(self, resource: SimHSQueue, drafter: int, step: int | None = None,
                 t_request: float | None = None) -> None:
        self.index = drafter
        self.step = step
        self.t_request = resource._env.now if t_request is None else t_request
        self.compute_s = 0.0  # set by the simulator when the take is granted
        super().__init__(resource)


class TakeRequest:
    """A take served at once, without a SimPy event: the synchronous twin of :class:`QueueGet`."""

    __slots__ = ("compute_s", "index", "step", "t_request")

    def __init__(self, drafter: int, step: int | None, now: float) -> None:
        self.index = drafter
        self.step = step
        self.t_request = now
        self.compute_s = 0.0


class _ByIndex(list):
    """Pending requests, kept sorted by worker index (stable among equal indices)."""

    def append(self, event: Any) -> None:
        i, index = len(self), event.index  # a few requests at most: a scan from the end beats bisect
        while i and self[i - 1].index > index:
            i -= 1
        self.insert(i, event)


class SimHSQueue(BaseResource):
    """The bucketed hidden-state queue on SimPy's clock."""

    PutQueue = _ByIndex
    GetQueue = _ByIndex

    def __init__(self, env: simpy.Environment, core: QueueCore,
                 on_take: Callable[[QueueGet, list[QueueItem], str, int, tuple[int, ...]], None]
                 | None = None, on_put: Callable[[float, QueueItem], None] | None = None) -> None:
        super().__init__(env, math.inf)
        self.core = core
        self.on_take = on_take
        self.on_put = on_put  # told (time, item) of every put as the queue decides it (streaming metrics)
        self._puts_scheduled = False
        self._takes_scheduled = False
        self._ending: dict[float, int] = {}  # compute end time -> computes ending then

    put = BoundClass(QueuePut)
    get = BoundClass(QueueGet)

    # ------------------------------------------------------------------ process API
    def try_put(self, item: QueueItem) -> bool:
        """The put decided at once, with no event, when nothing else happens at this instant, nobody
        is waiting to put and the item fits (the common case): True if it was put. Otherwise the
        producer goes through :meth:`put_item`, the ordered, deferred path; the decisions are the
        same either way. A plain call, not a generator, so the common case costs no generator."""
        core = self.core
        if (self.put_queue or self._puts_scheduled or self._env._now in self._ending  # type: ignore[attr-defined]
                or not core.fits(item)):
            return False
        now = self._env._now  # type: ignore[attr-defined]
        core.put(item, now)
        if self.on_put is not None:
            self.on_put(now, item)
        if self.get_queue:
            self._trigger_get(None)
        return True

    def put_item(self, item: QueueItem, worker: int) -> Generator[Event, Any, float]:
        """A producer's put: ``blocked_s = yield from queue.put_item(item, w)`` (:meth:`try_put` first)."""
        if self.try_put(item):
            return 0.0
        return (yield self.put(item, worker))

    def try_take(self, drafter: int, step: int | None, t_request: float) -> tuple[Any, list[QueueItem] | None] | None:
        """A take decided at once when nothing else happens at this instant: (request, items), with
        items None once producers have closed and the queue is drained; None when the drafter must
        wait (then :meth:`take_items`)."""
        if self.get_queue or self._takes_scheduled or self._puts_scheduled or \
                self._env._now in self._ending:  # type: ignore[attr-defined]
            return None
        core = self.core
        reason = core.gate()
        if reason is not None:
            request = TakeRequest(drafter, step, t_request)
            depth_before, bucket_depths = core.depth, tuple(core.counts)  # as _take, written out
            _, items = core.take(self._env._now)  # type: ignore[attr-defined]
            if self.on_take is not None:
                self.on_take(request, items, reason, depth_before, bucket_depths)
            if self.put_queue:
                self._admit()
            return request, items
        if core.closed and core.depth == 0:
            return TakeRequest(drafter, step, self._env.now), None
        return None

    def take_items(self, drafter: int, step: int | None = None, t_request: float | None = None
                   ) -> Generator[Event, Any, tuple[Any, list[QueueItem] | None]]:
        """A drafter's take: ``request, items = yield from queue.take_items(d, step)``.

        ``items`` is None once producers have closed and the queue is drained. ``t_request``
        (default: now) is when the drafter became ready to take, for its gate-wait time.
        """
        now = self._env._now  # type: ignore[attr-defined]
        got = self.try_take(drafter, step, now if t_request is None else t_request)
        if got is not None:
            return got
        event = self.get(drafter, step, t_request)
        items = yield event
        return event, items

    # ------------------------------------------------------------------ deferral
    def _schedule(self, callback: Callable[[Event], None], priority: int) -> None:
        ev = Event(self._env)
        ev._ok = True
        ev._value = None
        ev.callbacks.append(callback)  # type: ignore[union-attr]
        self._env.schedule(ev, priority)

    # ------------------------------------------------------------------ compute time
    def compute(self, seconds: float) -> Event:
        """The timeout of a producer's or drafter's compute. Processes that put or take must use
        it (not ``env.timeout``): the queue counts computes ending at each instant, which is how
        it knows whether another put or take can still happen at the current instant."""
        if seconds < 0:
            raise ValueError(f"negative compute time {seconds}")
        env = self._env
        end = env._now + seconds  # type: ignore[attr-defined]  # SimPy's own sum, same float
        ending = self._ending
        ending[end] = ending.get(end, 0) + 1
        # SimPy's Timeout.__init__ and Environment.schedule written out (as SimPy inlines its own
        # hot paths), with the queue's bookkeeping as the first callback: one compute per item.
        timeout = Timeout.__new__(Timeout)
        timeout.env = env
        timeout.callbacks = [self._compute_ended]
        timeout._value = None
        timeout._delay = seconds
        timeout._ok = True
        heappush(env._queue, (end, NORMAL, next(env._eid), timeout))  # type: ignore[attr-defined]
        return timeout

    def _compute_ended(self, _: Event) -> None:
        now = self._env._now  # type: ignore[attr-defined]
        n = self._ending[now] - 1
        if n:
            self._ending[now] = n
        else:
            del self._ending[now]

    def _alone_at_this_instant(self) -> bool:
        """True when no other compute ends at the current time: then no other put or take can
        happen at this instant, deciding now cannot break the same-instant order, and the settle
        event is skipped. Ties, as with deterministic timing, take the deferred, ordered path."""
        return self._env.now not in self._ending

    def _trigger_put(self, get_event: Any) -> None:
        if self._puts_scheduled:
            return
        if self._env._now not in self._ending:  # type: ignore[attr-defined]  # alone at this instant
            self._admit()
            if self.get_queue and self.core.gate() is not None:
                self._trigger_get(None)  # as _settle_puts
        else:
            self._puts_scheduled = True
            self._schedule(self._settle_puts, PUT_PRIORITY)

    def _trigger_get(self, put_event: Any) -> None:
        if self._takes_scheduled:
            return
        if self._env._now not in self._ending and not self._puts_scheduled:  # alone at this instant
            if self.get_queue:
                self._settle_takes(None)
        else:
            self._takes_scheduled = True
            self._schedule(self._settle_takes, TAKE_PRIORITY)

    def _settle_puts(self, _: Event | None) -> None:
        self._puts_scheduled = False
        self._admit()
        if self.get_queue and self.core.gate() is not None:
            self._trigger_get(None)  # e.g. a producer just blocked at the cap opened the gate

    def _settle_takes(self, _: Event | None) -> None:
        self._takes_scheduled = False
        q = self.get_queue
        while q:
            ev = q[0]
            if not self._do_get(ev):
                break
            q.pop(0)
            if self.put_queue:  # admit producers blocked at the cap before the next take
                self._admit()

    # ------------------------------------------------------------------ decisions
    def _admit(self) -> None:
        """Settle waiting puts in worker order: SimPy's ``BaseResource._trigger_put`` loop over
        :meth:`_do_put`, written out for the depth cap (the hot path when producers wait at the
        cap): admit while the head fits; the first that does not fit blocks everyone behind it."""
        core = self.core
        if core.config.max_bytes is not None:  # a smaller item behind may still fit: the general loop
            BaseResource._trigger_put(self, None)
            return
        q = self.put_queue
        on_put = self.on_put
        blocked = core.blocked
        while q:
            ev = q[0]
            item = ev.item
            if not core.fits(item):
                if len(blocked) < len(q):  # else everyone waiting is marked already
                    for e in q:
                        if e.index not in blocked:
                            core.block(e.index, e.item.nbytes)
                return
            del q[0]
            if blocked:
                core.unblock(ev.index)
            now = self._env._now  # type: ignore[attr-defined]
            core.put(item, now)
            if on_put is not None:
                on_put(now, item)
            ev.succeed(now - ev.t_request)

    def _do_put(self, event: QueuePut) -> bool:  # type: ignore[override]
        core = self.core
        if core.fits(event.item):
            if core.blocked:
                core.unblock(event.index)
            now = self._env._now  # type: ignore[attr-defined]
            core.put(event.item, now)
            if self.on_put is not None:
                self.on_put(now, event.item)
            event.succeed(now - event.t_request)
            return True
        core.block(event.index, event.item.nbytes)
        # With a depth cap nobody behind this producer fits either; with a byte cap a later
        # producer's smaller item still may. Producers not reached are marked blocked below.
        if core.config.max_bytes is None:
            for ev in self.put_queue:
                if ev.index not in core.blocked:
                    core.block(ev.index, ev.item.nbytes)
            return False
        return True

    def _do_get(self, event: QueueGet) -> bool:  # type: ignore[override]
        core = self.core
        reason = core.gate()
        if reason is None:
            if core.closed and core.depth == 0:
                event.succeed(None)
                return True
            return False
        event.succeed(self._take(event, reason))
        return True

    def _take(self, request: QueueGet | TakeRequest, reason: str) -> list[QueueItem]:
        core = self.core
        depth_before = core.depth
        bucket_depths = tuple(core.counts)
        _, items = core.take(self._env._now)  # type: ignore[attr-defined]
        if self.on_take is not None:
            self.on_take(request, items, reason, depth_before, bucket_depths)
        return items

    def close(self) -> None:
        """Producers are done: drafters drain, then their gets return None."""
        self.core.close()
        self._trigger_get(None)


def item_stream(specs: Iterator[Any], limit: int | None) -> Iterator[Any]:
    """The shared data loader: producers draw the next item from one ordered stream."""
    for n, spec in enumerate(specs):
        if limit is not None and n >= limit:
            return
        yield spec
