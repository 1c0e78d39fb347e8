"""Property tests: real producer and drafter threads on the thread-safe queue.

Every wait has a timeout, so a deadlock fails the example instead of hanging CI.
"""

from __future__ import annotations

import threading
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash.core.config import QueueConfig
from dflash.core.queue_core import GATE_CAP, GATE_DRAIN, GATE_READY, QueueItem
from dflash.pipeline.hsqueue import HSQueue
from tests.conftest import ALL_POLICIES

WAIT_S = 10.0
N_BUCKETS = 4


@st.composite
def scenarios(draw: st.DrawFn) -> dict:
    max_depth = draw(st.integers(1, 10))
    cfg = QueueConfig(
        min_ready=draw(st.integers(1, max_depth)), max_depth=max_depth,
        max_bytes=draw(st.one_of(st.none(), st.integers(1, 60))),
        policy=draw(st.sampled_from(ALL_POLICIES)), gate=draw(st.sampled_from(["threshold", "hysteresis"])),
        items_per_take=draw(st.integers(1, 3)))
    n_prod = draw(st.integers(1, 3))
    streams = [draw(st.lists(st.tuples(st.integers(0, N_BUCKETS - 1), st.integers(1, 20)), max_size=40))
               for _ in range(n_prod)]
    return {"cfg": cfg, "streams": streams, "n_drafters": draw(st.integers(1, 3)),
            "seed": draw(st.integers(0, 1000))}


def run_threads(cfg: QueueConfig, streams: list[list[tuple[int, int]]], n_drafters: int,
                seed: int) -> tuple[HSQueue, list[str], list[BaseException], float]:
    q = HSQueue(cfg, N_BUCKETS, seed=seed, mix=[0.25] * N_BUCKETS)
    errors: list[BaseException] = []
    taken: list[str] = []
    taken_lock = threading.Lock()

    def producer(w: int) -> None:
        try:
            for k, (bucket, nbytes) in enumerate(streams[w]):
                q.put(QueueItem(f"p{w}-{k}", bucket, nbytes=nbytes), worker=w, timeout=WAIT_S)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    def drafter(d: int) -> None:
        try:
            while (items := q.take(drafter=d, timeout=WAIT_S)) is not None:
                with taken_lock:
                    taken.extend(i.item_id for i in items)
                q.task_done(items)
        except BaseException as exc:
            errors.append(exc)

    prods = [threading.Thread(target=producer, args=(w,)) for w in range(len(streams))]
    drafts = [threading.Thread(target=drafter, args=(d,)) for d in range(n_drafters)]
    for t in prods + drafts:
        t.start()
    for t in prods:
        t.join(3 * WAIT_S)
    close_t = q.now()
    q.close()
    for t in drafts:
        t.join(3 * WAIT_S)
    assert not any(t.is_alive() for t in prods + drafts), "a thread never finished (deadlock)"
    return q, taken, errors, close_t


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_threads_take_every_item_exactly_once_within_cap_and_gate(sc: dict) -> None:
    cfg: QueueConfig = sc["cfg"]
    q, taken, errors, close_t = run_threads(cfg, sc["streams"], sc["n_drafters"], sc["seed"])
    assert errors == []
    produced = [f"p{w}-{k}" for w, s in enumerate(sc["streams"]) for k in range(len(s))]
    counts = Counter(taken)
    assert set(counts) == set(produced) and all(c == 1 for c in counts.values())

    stats = q.stats()
    assert stats["max_depth_seen"] <= cfg.max_depth
    biggest = max((nb for s in sc["streams"] for _, nb in s), default=0)
    if cfg.max_bytes is not None:
        assert stats["peak_queued_bytes"] <= max(cfg.max_bytes, biggest)
    assert stats["produced"] == stats["trained"] == len(produced)
    assert stats["discarded_at_stop"] == 0 and stats["in_flight"] == 0

    for rec in q.take_log():
        assert rec.gate in (GATE_READY, GATE_CAP, GATE_DRAIN)
        if rec.gate == GATE_READY and cfg.gate == "threshold":
            assert rec.depth_before >= cfg.min_ready, "took below the gate before drain"
        if rec.gate == GATE_DRAIN:
            assert rec.t >= close_t
        assert len(rec.item_ids) <= cfg.items_per_take
        assert sum(rec.bucket_depths) == rec.depth_before


def test_stop_discards_and_accounts_for_every_item() -> None:
    cfg = QueueConfig(min_ready=2, max_depth=4)
    q = HSQueue(cfg, 2)
    results: list[float | None] = []

    def producer() -> None:
        for k in range(10):
            results.append(q.put(QueueItem(f"x{k}", k % 2), timeout=WAIT_S))
            if results[-1] is None:  # the run stopped: a producer stops producing
                return

    t = threading.Thread(target=producer)
    t.start()
    first = q.take(timeout=WAIT_S)
    assert first is not None
    q.task_done(first)
    while not (q.qsize() == 4 and q.stats()["blocked_producers"] == 1):
        threading.Event().wait(0.001)
    q.stop()
    t.join(WAIT_S)
    assert not t.is_alive()
    assert q.take(timeout=WAIT_S) is None
    s = q.stats()
    # 1 trained, 4 queued at stop, 1 held by the blocked producer: all produced items accounted for
    assert s["trained"] == 1 and s["discarded_at_stop"] == 5
    assert s["produced"] == s["trained"] + s["discarded_at_stop"] == 6


def test_live_reconfigure_releases_waiting_drafter() -> None:
    q = HSQueue(QueueConfig(min_ready=5, max_depth=10), 1)
    for k in range(3):
        q.put(QueueItem(f"y{k}", 0))
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(q.take(timeout=WAIT_S)))
    t.start()
    q.reconfigure(QueueConfig(min_ready=3, max_depth=10))
    t.join(WAIT_S)
    assert got and got[0] is not None and q.config.min_ready == 3
