"""docs/ARCHITECTURE.md's queue semantics, one rule per test, on the clock-free core."""

from __future__ import annotations

import pytest

from dflash.core.queue_core import GATE_CAP, GATE_DRAIN, GATE_READY, QueueCore
from tests.conftest import make_item, qcfg


def core_with(n: int, n_buckets: int = 1, **kw) -> QueueCore:
    core = QueueCore(qcfg(**kw), n_buckets)
    for i in range(n):
        core.put(make_item(i, i % n_buckets, nbytes=10), float(i))
    return core


@pytest.mark.parametrize(("depth", "min_ready", "open_"), [(0, 1, False), (2, 3, False), (3, 3, True),
                                                           (5, 3, True)])
def test_threshold_gate_opens_at_min_ready(depth: int, min_ready: int, open_: bool) -> None:
    core = core_with(depth, min_ready=min_ready)
    assert (core.gate() == GATE_READY) is open_


def test_gate_opens_for_a_producer_blocked_at_the_cap_even_below_min_ready() -> None:
    core = core_with(2, min_ready=5, max_depth=8, max_bytes=20)
    assert core.gate() is None
    assert not core.fits(make_item(99, 0, nbytes=10))  # byte cap: 20 + 10 > 20
    core.block(producer=0, nbytes=10)
    assert core.gate() == GATE_CAP
    core.unblock(0)
    assert core.gate() is None


def test_drain_after_close_until_empty() -> None:
    core = core_with(2, min_ready=5)
    core.close()
    assert core.gate() == GATE_DRAIN
    core.take(0.0)
    core.take(0.0)
    assert core.gate() is None
    with pytest.raises(RuntimeError):
        core.put(make_item(7, 0), 0.0)


def test_depth_cap_blocks_at_max_depth() -> None:
    core = core_with(3, min_ready=1, max_depth=3)
    assert not core.fits(make_item(9, 0))
    core.take(0.0)
    assert core.fits(make_item(9, 0))


def test_an_item_larger_than_the_byte_cap_still_fits_an_empty_queue() -> None:
    core = QueueCore(qcfg(max_bytes=5), 1)
    assert core.fits(make_item(0, 0, nbytes=50))


def test_hysteresis_stays_open_until_empty_then_waits_for_min_ready_again() -> None:
    core = core_with(3, min_ready=3, gate="hysteresis")
    assert core.gate() == GATE_READY
    core.take(0.0)
    assert core.gate() == GATE_READY  # depth 2 < 3 but the latch is open
    core.take(0.0)
    core.take(0.0)
    core.put(make_item(10, 0), 1.0)
    core.put(make_item(11, 0), 1.0)
    assert core.gate() is None  # emptied: closed until depth reaches 3 again
    core.put(make_item(12, 0), 1.0)
    assert core.gate() == GATE_READY


def test_threshold_gate_closes_as_soon_as_depth_drops_below_min_ready() -> None:
    core = core_with(3, min_ready=3)
    core.take(0.0)
    assert core.gate() is None


def test_items_per_take_takes_min_of_count_and_setting() -> None:
    core = core_with(5, n_buckets=1, min_ready=1, items_per_take=3)
    assert len(core.take(0.0)[1]) == 3
    assert len(core.take(0.0)[1]) == 2


def test_stop_discards_queued_items_and_counts_them() -> None:
    core = core_with(4, min_ready=1)
    core.take(0.0)
    discarded = core.discard_all()
    assert len(discarded) == 3
    assert core.counters.discarded_at_stop == 3
    assert core.depth == 0 and core.queued_bytes == 0


def test_reconfigure_applies_between_takes() -> None:
    core = core_with(4, min_ready=5, max_depth=8)
    assert core.gate() is None
    core.reconfigure(qcfg(min_ready=4, max_depth=8, policy="fifo"))
    assert core.gate() == GATE_READY
    assert core.policy.name == "fifo"


def test_item_age_is_tracked_per_bucket() -> None:
    core = QueueCore(qcfg(policy="fifo"), 2)
    core.put(make_item(0, 1), 1.0)
    core.take(6.5)
    assert core.counters.per_bucket_max_age_s == [0.0, 5.5]


def test_queued_ids_in_put_order_for_checkpoints() -> None:
    core = core_with(5, n_buckets=3)
    assert core.queued_ids() == [f"i{i}" for i in range(5)]


def test_rng_and_policy_state_round_trip() -> None:
    a = core_with(30, n_buckets=3, max_depth=40, policy="random_item")
    b = core_with(30, n_buckets=3, max_depth=40, policy="random_item")
    a.take(0.0)
    b.take(0.0)
    state = a.state_dict()
    expected = [a.take(0.0)[0] for _ in range(10)]
    b.load_state_dict(state)
    assert [b.take(0.0)[0] for _ in range(10)] == expected
