"""The SimPy internals the engine reads still exist and still mean what the engine assumes.

simulator/engine.py and simulator/run.py read SimPy's private clock ``env._now`` on their per-item
paths (the public ``env.now`` property costs +11% of a whole run there: benchmarks/simulator_speed.py),
build compute timeouts by hand (``Timeout._delay``, ``Event._ok``/``_value``, pushed onto
``env._queue`` with ``next(env._eid)``) and override SimPy's resource triggers. A SimPy release that
renamed one of them would give wrong results silently, not an error; these tests fail naming it.
pyproject.toml bounds SimPy to the releases these tests passed on.
"""

from __future__ import annotations

import itertools

import pytest
import simpy
from simpy.core import BoundClass
from simpy.events import NORMAL, URGENT, Event, Timeout
from simpy.resources.base import BaseResource, Get, Put

from dflash.core.config import QueueConfig
from dflash.core.queue_core import QueueCore, QueueItem
from simulator.engine import SimHSQueue


def _internal(obj: object, name: str, where: str) -> object:
    assert hasattr(obj, name), f"SimPy internal {where}.{name} is gone (simulator/engine.py, run.py read it)"
    return getattr(obj, name)


def test_environment_clock_is_the_private_now():
    env = simpy.Environment(initial_time=2.5)
    assert _internal(env, "_now", "Environment") == 2.5
    env.timeout(1.0)
    env.run()
    assert env._now == env.now == 3.5, "Environment._now no longer is the clock behind Environment.now"


def test_event_queue_is_a_heap_of_time_priority_id_event():
    env = simpy.Environment()
    queue = _internal(env, "_queue", "Environment")
    eid = _internal(env, "_eid", "Environment")
    assert isinstance(queue, list), "Environment._queue is no longer a list (the engine heappushes onto it)"
    assert isinstance(eid, type(itertools.count())), "Environment._eid is no longer an itertools.count"
    ev = env.timeout(2.0)
    assert len(queue) == 1
    t, priority, n, event = queue[0]
    assert (t, priority, event) == (2.0, NORMAL, ev), \
        "Environment._queue entries are no longer (time, priority, eid, event)"
    assert isinstance(n, int)


def test_priorities_leave_room_after_normal():
    # the engine settles same-instant puts and takes at priorities 2 and 3, after every ordinary event
    assert (URGENT, NORMAL) == (0, 1), "SimPy's URGENT/NORMAL priorities changed"


def test_event_outcome_fields():
    env = simpy.Environment()
    ev = Event(env)
    _internal(ev, "_value", "Event")
    ev.succeed("x")
    assert _internal(ev, "_ok", "Event") is True and ev._value == "x", \
        "Event._ok/_value no longer hold the outcome"


def test_timeout_delay_field():
    env = simpy.Environment()
    t = env.timeout(4.0)
    assert _internal(t, "_delay", "Timeout") == 4.0
    assert isinstance(t, Timeout)


def test_resource_hooks_the_queue_overrides():
    for name in ("_trigger_put", "_trigger_get", "_do_put", "_do_get", "put_queue", "get_queue"):
        assert name in dir(BaseResource) or name in BaseResource.__init__.__code__.co_names, \
            f"SimPy internal BaseResource.{name} is gone (simulator/engine.py overrides or reads it)"
    res = BaseResource(simpy.Environment(), 1)
    _internal(res, "_env", "BaseResource")
    assert issubclass(Put, Event) and issubclass(Get, Event)
    assert BoundClass is not None


def test_hand_built_compute_timeout_fires_like_simpys_own():
    """The engine's hand-built timeout (the internals above, together) fires at the same time and in
    the same order as env.timeout, and its callbacks run."""
    env = simpy.Environment()
    queue = SimHSQueue(env, QueueCore(QueueConfig(min_ready=1, max_depth=4), 1))
    log: list[tuple[str, float]] = []

    def proc(name: str, seconds: float, own: bool):
        yield queue.compute(seconds) if own else env.timeout(seconds)
        log.append((name, env.now))

    env.process(proc("own", 1.5, True))
    env.process(proc("simpy", 1.5, False))
    env.process(proc("own-late", 2.0, True))
    env.run()
    assert log == [("own", 1.5), ("simpy", 1.5), ("own-late", 2.0)]
    assert queue._ending == {}, "the compute-ended callback did not run"


@pytest.mark.parametrize("min_ready", [1, 2])
def test_put_and_take_through_the_overridden_triggers(min_ready):
    env = simpy.Environment()
    core = QueueCore(QueueConfig(min_ready=min_ready, max_depth=2), 1)
    queue = SimHSQueue(env, core)
    taken: list[tuple[float, str]] = []

    def producer():
        for k in range(3):
            yield queue.compute(1.0)
            yield from queue.put_item(QueueItem(f"i{k}", 0), 0)
        queue.close()

    def drafter():
        while True:
            _, items = yield from queue.take_items(0)
            if items is None:
                return
            taken.append((env.now, items[0].item_id))
            yield queue.compute(2.5)

    env.process(producer())
    env.process(drafter())
    env.run()
    assert [i for _, i in taken] == ["i0", "i1", "i2"]
    assert taken[0][0] == float(min_ready)  # the gate opens once min_ready items are queued
