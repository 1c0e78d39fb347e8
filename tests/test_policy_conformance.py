"""One conformance suite that every selection policy must pass (as Optuna does for storages)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.core.policies import POLICY_CLASSES, make_policy
from dflash.core.queue_core import QueueCore
from tests.conftest import ALL_POLICIES, make_item, qcfg


def _fill(core: QueueCore, buckets: list[int], start: int = 0) -> None:
    for i, b in enumerate(buckets, start):
        core.put(make_item(i, b), t=float(i))


def test_every_policy_is_registered_under_its_name() -> None:
    assert set(POLICY_CLASSES) == {"fullest", "fifo", "random_item", "random_bucket", "proportional"}
    for name, cls in POLICY_CLASSES.items():
        assert cls.name == name


@settings(max_examples=60, deadline=None)
@given(buckets=st.lists(st.integers(0, 4), min_size=1, max_size=60), per_take=st.integers(1, 4),
       seed=st.integers(0, 2**16), name=st.sampled_from(ALL_POLICIES))
def test_takes_only_from_nonempty_buckets_with_specified_sizes(buckets: list[int], per_take: int,
                                                                seed: int, name: str) -> None:
    core = QueueCore(qcfg(policy=name, max_depth=64, items_per_take=per_take), 5, seed=seed,
                     mix=[0.1, 0.1, 0.2, 0.2, 0.4])
    _fill(core, buckets)
    while core.depth:
        before = list(core.counts)
        b, entries = core.take(t=100.0)
        assert before[b] > 0, "policy chose an empty bucket"
        assert len(entries) == min(before[b], per_take)
        assert all(item.bucket == b for item in entries)


@settings(max_examples=60, deadline=None)
@given(buckets=st.lists(st.integers(0, 3), min_size=1, max_size=60), per_take=st.integers(1, 3),
       seed=st.integers(0, 2**16), name=st.sampled_from(ALL_POLICIES))
def test_oldest_first_inside_a_bucket(buckets: list[int], per_take: int, seed: int, name: str) -> None:
    core = QueueCore(qcfg(policy=name, max_depth=64, items_per_take=per_take), 4, seed=seed)
    _fill(core, buckets)
    seen: dict[int, list[int]] = {}
    while core.depth:
        b, entries = core.take(t=100.0)
        seen.setdefault(b, []).extend(int(item.item_id[1:]) for item in entries)  # ids are i<put order>
    for b, seqs in seen.items():
        assert seqs == sorted(seqs), f"bucket {b} not taken oldest first"


def _take_log(name: str, seed: int) -> list[tuple[int, tuple[str, ...]]]:
    rng = random.Random(99)  # the arrival stream is fixed; only the queue seed varies
    core = QueueCore(qcfg(policy=name, max_depth=40, items_per_take=2), 5, seed=seed,
                     mix=[0.05, 0.05, 0.1, 0.2, 0.6])
    log, i = [], 0
    for _ in range(300):
        while core.depth < 30:
            core.put(make_item(i, rng.choices(range(5), [0.05, 0.05, 0.1, 0.2, 0.6])[0]), t=i)
            i += 1
        b, entries = core.take(t=i)
        log.append((b, tuple(item.item_id for item in entries)))
    return log


def test_deterministic_under_a_seed(policy_name: str) -> None:
    assert _take_log(policy_name, seed=7) == _take_log(policy_name, seed=7)


@pytest.mark.parametrize("name", ["random_item", "random_bucket"])
def test_random_policies_depend_on_the_seed(name: str) -> None:
    assert _take_log(name, seed=1) != _take_log(name, seed=2)


def test_fullest_takes_the_fullest_bucket() -> None:
    core = QueueCore(qcfg(policy="fullest", max_depth=20), 3)
    _fill(core, [0, 1, 1, 2, 2, 2])
    assert core.take(0.0)[0] == 2


def test_fifo_takes_the_oldest_items_bucket() -> None:
    core = QueueCore(qcfg(policy="fifo", max_depth=20), 3)
    _fill(core, [2, 0, 0, 1])
    assert [core.take(0.0)[0] for _ in range(4)] == [2, 0, 0, 1]


def test_random_item_is_uniform_over_items() -> None:
    core = QueueCore(qcfg(policy="random_item", max_depth=100), 2, seed=3)
    _fill(core, [0] * 25 + [1] * 75)
    counts: Counter[int] = Counter()
    for i in range(4000):
        b = core.take(0.0)[0]
        counts[b] += 1
        core.put(make_item(1000 + i, b), 0.0)  # put back the same bucket: composition stays 1:3
    # binomial sd at n=4000 is 0.0068; allow four of them
    assert abs(counts[1] / 4000 - 0.75) < 0.028


def test_proportional_stays_within_half_a_percent_of_p_over_10000_takes() -> None:
    p = [0.024, 0.030, 0.102, 0.161, 0.683]
    core = QueueCore(qcfg(policy="proportional", max_depth=60, min_ready=1), 5, mix=p, seed=0)
    rng = random.Random(5)
    taken = [0] * 5
    i = 0
    for _ in range(10_000):
        while core.depth < 50:  # arrivals follow the long-bucket-heavy stream
            core.put(make_item(i, rng.choices(range(5), p)[0]), t=i)
            i += 1
        b, entries = core.take(t=i)
        taken[b] += len(entries)
    shares = [t / sum(taken) for t in taken]
    assert max(abs(s - pb) for s, pb in zip(shares, p)) < 0.005


def test_proportional_state_round_trips() -> None:
    pol = make_policy("proportional", 3, [0.2, 0.3, 0.5])
    pol.on_take(2, 3)
    clone = make_policy("proportional", 3, [0.2, 0.3, 0.5])
    clone.load_state_dict(pol.state_dict())
    assert clone.choose([1, 1, 1], [0, 1, 2], 3, random.Random()) == pol.choose(
        [1, 1, 1], [0, 1, 2], 3, random.Random())
