"""One queue, two clocks: the trainer's coordinator and the SimPy engine make identical decisions.

Both are fed one arrival trace with deterministic timing: per producer, a list of (compute
seconds, item); per drafter, a list of compute seconds per take. The trainer's side is the rank
job's :class:`dflash.pipeline.coordinator.Coordinator` (the only queue that trains: the pure
decisions the coordinator thread runs), driven in docs/ARCHITECTURE.md's same-instant order (puts before
takes; producers and drafters by index) as its service thread applies it. The SimPy side runs
:class:`simulator.engine.SimHSQueue` with ordinary SimPy processes. The take logs (drafter, bucket,
item ids, in order) must be identical for every policy and both gates, with caps that bind and
ties that happen, for three targets + two drafters and two + two.
"""

from __future__ import annotations

import heapq
import random

import pytest
import simpy

from dflash.core.autopilot import Autopilot, AutopilotConfig, QueueState
from dflash.core.config import QueueConfig
from dflash.core.queue_core import QueueCore, QueueItem
from simulator.engine import SimHSQueue
from tests.conftest import ALL_POLICIES

N_BUCKETS = 4
MIX = [0.1, 0.2, 0.3, 0.4]

Trace = tuple[list[list[tuple[float, QueueItem]]], list[list[float]]]


def make_trace(seed: int, n_prod: int = 3, n_draft: int = 2, items_per_prod: int = 40,
               byte_sizes: bool = False) -> Trace:
    """Deterministic timing on a coarse grid (multiples of 0.5 s), so same-instant ties happen."""
    rng = random.Random(seed)
    producers = []
    for w in range(n_prod):
        stream = []
        for k in range(items_per_prod):
            b = rng.choices(range(N_BUCKETS), MIX)[0]
            nbytes = rng.choice([10, 20, 40]) if byte_sizes else 10
            stream.append((0.5 * rng.randint(1, 4), QueueItem(f"w{w}-{k}", b, nbytes=nbytes)))
        producers.append(stream)
    drafters = [[0.5 * rng.randint(1, 6) for _ in range(10 * items_per_prod)] for _ in range(n_draft)]
    return producers, drafters


# --------------------------------------------------------------------------- SimPy side
def run_simpy(cfg: QueueConfig, trace: Trace, seed: int, reasons: list[str] | None = None,
              autopilot: Autopilot | None = None,
              controls: list[tuple[float, dict]] | None = None) -> list[tuple[int, int, tuple[str, ...]]]:
    """With ``autopilot``: wired as ``simulator/run.py`` wires it (every put and take observed, a decision
    applied to the core inside the take), its decisions appended to ``controls``."""
    producers, drafters = trace
    env = simpy.Environment()
    log: list[tuple[int, int, tuple[str, ...]]] = []
    core = QueueCore(cfg, N_BUCKETS, mix=MIX, seed=seed)
    computed_at: dict[str, float] = {}

    def on_take(ev, items, reason, depth_before, bucket_depths):
        log.append((ev.index, items[0].bucket, tuple(i.item_id for i in items)))
        if reasons is not None:
            reasons.append(reason)
        if autopilot is not None:
            autopilot.observe_take(env.now, items[0].bucket, len(items), env.now - ev.t_request)
            d = autopilot.decide(env.now, QueueState(core.depth, core.queued_bytes, len(core.blocked)))
            if d is not None:
                core.reconfigure(d.config)
                assert controls is not None
                controls.append((d.t, d.change))

    def on_put(t, item):
        if autopilot is not None:
            autopilot.observe_put(t, item.bucket, item.nbytes, t - computed_at[item.item_id])

    queue = SimHSQueue(env, core, on_take, on_put)
    left = [len(producers)]

    def producer(w):
        for dur, item in producers[w]:
            yield queue.compute(dur)
            computed_at[item.item_id] = env.now
            yield from queue.put_item(item, w)
        left[0] -= 1
        if left[0] == 0:
            queue.close()

    def drafter(d):
        for dur in drafters[d]:
            _, items = yield from queue.take_items(d)
            if items is None:
                return
            yield queue.compute(dur)
        raise AssertionError("trace too short for the drafters")

    for w in range(len(producers)):
        env.process(producer(w))
    for d in range(len(drafters)):
        env.process(drafter(d))
    env.run(until=10_000)
    return log


# --------------------------------------------------------------------------- the specification
CASES = [
    # (min_ready, max_depth, items_per_take, max_bytes)
    (1, 3, 1, None),
    (4, 6, 1, None),
    (5, 5, 2, None),
    (3, 8, 3, 60),
]


@pytest.mark.parametrize(("min_ready", "max_depth", "per_take", "max_bytes"), CASES)
def test_the_traces_exercise_ties_the_cap_and_the_drain(min_ready: int, max_depth: int, per_take: int,
                                                       max_bytes: int | None) -> None:
    """Guard against a vacuous equivalence: the scenarios hit same-instant ties, the cap and drain."""
    trace = make_trace(seed=min_ready * 31 + max_depth, byte_sizes=max_bytes is not None)
    finish_times = []
    for stream in trace[0]:
        t = 0.0
        for dur, _ in stream:
            t += dur
            finish_times.append(t)
    assert len(finish_times) > len(set(finish_times))  # ties among producers
    reasons: list[str] = []
    cfg = QueueConfig(min_ready=min_ready, max_depth=max_depth, items_per_take=per_take,
                      max_bytes=max_bytes, policy="random_item")
    run_simpy(cfg, trace, seed=5, reasons=reasons)
    assert "cap" in reasons
    if min_ready > 1:  # with min_ready 1 a drain take is indistinguishable from a ready one
        assert "drain" in reasons


# --------------------------------------------------------------------------- the distributed coordinator
def run_coordinator(cfg: QueueConfig, trace: Trace, seed: int, autopilot: Autopilot | None = None,
                    controls: list[tuple[float, dict]] | None = None) -> list[tuple[int, int, tuple[str, ...]]]:
    """Discrete-event driver of the multi-rank coordinator's pure decisions.

    The same-instant order is the service thread's: every ready report of an instant is applied (in
    producer order) before one ``serve`` answers the waiting drafters.
    """
    from dflash.pipeline.coordinator import Admit, Assignment, Coordinator, NoWork

    producers, drafters = trace
    coord = Coordinator(cfg, N_BUCKETS, len(producers), len(drafters), mix=MIX, seed=seed, sync="none",
                        autopilot=autopilot)
    events: list[tuple[float, int, int]] = []
    next_item = [0] * len(producers)
    takes_done = [0] * len(drafters)
    drained: set[int] = set()
    log: list[tuple[int, int, tuple[str, ...]]] = []
    rounds: list[int] = []

    def schedule_producer(w: int, t: float) -> None:
        if next_item[w] < len(producers[w]):
            heapq.heappush(events, (t + producers[w][next_item[w]][0], 0, w))
        else:
            coord.producer_closed(w)

    def apply(actions, t: float) -> None:
        for a in actions:
            if isinstance(a, Admit):
                next_item[a.producer] += 1
                schedule_producer(a.producer, t)
            elif isinstance(a, Assignment):
                log.append((a.drafter, a.bucket, tuple(i.item_id for i in a.items)))
                rounds.extend(x.round for x in a.transfers)
                assert all(x.producer == int(x.item_id[1]) for x in a.transfers)  # "w{producer}-{k}"
                heapq.heappush(events, (t + drafters[a.drafter][takes_done[a.drafter]], 1, a.drafter))
                takes_done[a.drafter] += 1
            elif isinstance(a, NoWork):
                drained.add(a.drafter)

    def serve(t: float) -> None:
        while actions := coord.serve(t):  # an admitted last item closes its producer: serve again
            apply(actions, t)

    for w in range(len(producers)):
        schedule_producer(w, 0.0)
    for d in range(len(drafters)):
        coord.request(d, None, 0.0)
    serve(0.0)
    while len(drained) < len(drafters):
        assert events or coord.waiting, "driver stalled"
        t = events[0][0]
        batch = []
        while events and events[0][0] == t:
            batch.append(heapq.heappop(events))
        for _, kind, idx in sorted(batch, key=lambda e: (e[1], e[2])):  # puts before takes, by index
            if kind == 0:
                if coord.ready(idx, producers[idx][next_item[idx]][1], t):
                    next_item[idx] += 1
                    schedule_producer(idx, t)
            else:
                coord.request(idx, None, t)
        serve(t)
    assert rounds == list(range(1, len(rounds) + 1))  # one global, gap-free round numbering
    if controls is not None:
        controls.extend((c["t"], c["change"]) for c in coord.controls)
    return log


@pytest.mark.parametrize("gate", ["threshold", "hysteresis"])
@pytest.mark.parametrize("policy", ALL_POLICIES)
@pytest.mark.parametrize(("min_ready", "max_depth", "per_take", "max_bytes"), CASES)
@pytest.mark.parametrize("n_prod", [3, 2])
def test_the_coordinator_decides_like_the_simulator(policy: str, gate: str, min_ready: int, max_depth: int,
                                                    per_take: int, max_bytes: int | None, n_prod: int) -> None:
    cfg = QueueConfig(min_ready=min_ready, max_depth=max_depth, items_per_take=per_take,
                      max_bytes=max_bytes, policy=policy, gate=gate)
    trace = make_trace(seed=min_ready * (31 if n_prod == 3 else 17) + max_depth, n_prod=n_prod, n_draft=2,
                       byte_sizes=max_bytes is not None)
    sim_log = run_simpy(cfg, trace, seed=7)
    coord_log = run_coordinator(cfg, trace, seed=7)
    assert sum(len(ids) for _, _, ids in sim_log) == sum(len(s) for s in trace[0])  # each item once
    assert coord_log == sim_log
    assert {d for d, _, _ in coord_log} == {0, 1}  # both drafters took


@pytest.mark.parametrize("policy", ["random_item", "fullest", "proportional"])
@pytest.mark.parametrize(("min_ready", "max_depth"), [(4, 12), (10, 20)])
@pytest.mark.parametrize("n_prod", [3, 2])
def test_the_coordinator_and_the_simulator_steer_the_autopilot_alike(policy: str, min_ready: int, max_depth: int,
                                                                     n_prod: int) -> None:
    """``[queue] mode = "auto"``: the same trace gives the same takes and the same knob changes at the same
    instants in the coordinator (the trainer) and the SimPy engine (the simulator), and the knobs do move."""
    cfg = QueueConfig(min_ready=min_ready, max_depth=max_depth, policy=policy, mode="auto", auto_min_ready=2)
    trace = make_trace(seed=min_ready * 13 + max_depth + n_prod, n_prod=n_prod, n_draft=2, items_per_prod=60)

    def pilot() -> Autopilot:
        return Autopilot(AutopilotConfig(cfg, MIX, window=2, n_target=n_prod, n_drafter=2, seed=11))

    sim_controls: list[tuple[float, dict]] = []
    coord_controls: list[tuple[float, dict]] = []
    sim_log = run_simpy(cfg, trace, seed=7, autopilot=pilot(), controls=sim_controls)
    coord_log = run_coordinator(cfg, trace, seed=7, autopilot=pilot(), controls=coord_controls)
    assert sim_controls, "the autopilot changed nothing: the case does not test it"
    assert coord_controls == sim_controls
    assert coord_log == sim_log
