"""The mix phenomena the product is about, pinned on synthetic streams through the real core."""

from __future__ import annotations

import math
import random

import pytest

from dflash.core.config import WorkloadConfig
from dflash.core.mixmetrics import expected_window_entropy, mix_metrics
from dflash.core.queue_core import QueueCore, QueueItem
from dflash.core.sampler import Sampler
from tests.conftest import SHAREGPT_BOUNDS, qcfg, synthetic_lengths

W = 32


def grouped_stream(n_seqs: int = 6000, seed: int = 0, order: str = "length_grouped") -> Sampler:
    wl = WorkloadConfig(max_len=2048, bucket_bounds=SHAREGPT_BOUNDS, seqs_per_item=2, order=order,
                        mega_batch=64)
    return Sampler(synthetic_lengths(n_seqs, seed), wl, seed=seed)


def held_depth_run(policy: str, depth: int, sampler: Sampler, takes: int = 4000, seed: int = 1):
    """Keep the queue at ``depth`` items: take one, put the next arrival (a saturated producer)."""
    p = sampler.item_mix()
    core = QueueCore(qcfg(policy=policy, min_ready=depth, max_depth=depth), sampler.n_buckets,
                     mix=p, seed=seed)
    arrivals = sampler.iter_items()
    for _ in range(depth):
        spec = next(arrivals)
        core.put(QueueItem(spec.item_id, spec.bucket, padded_len=spec.padded_len), 0.0)
    buckets, lens = [], []
    for _ in range(takes):
        b, taken = core.take(0.0)
        for item in taken:
            buckets.append(b)
            lens.append(item.padded_len)
        spec = next(arrivals)
        core.put(QueueItem(spec.item_id, spec.bucket, padded_len=spec.padded_len), 0.0)
    return mix_metrics(buckets, lens, buckets, p, window=W)


@pytest.fixture(scope="module")
def sampler() -> Sampler:
    return grouped_stream()


def test_fullest_mixes_worse_than_random_item_at_equal_depth(sampler: Sampler) -> None:
    for depth in (10, 30, 90):
        full = held_depth_run("fullest", depth, sampler)
        rand = held_depth_run("random_item", depth, sampler)
        assert full.mix_efficiency < rand.mix_efficiency - 0.05, depth


def test_random_item_efficiency_rises_with_depth_under_length_grouped_arrivals(sampler: Sampler) -> None:
    eff = [held_depth_run("random_item", d, sampler).mix_efficiency for d in (4, 10, 30, 90)]
    # rises steeply, then saturates near 1.0 once the buffer spans a mega-batch (window-to-window
    # standard error here is ~0.01, hence the tolerance on the saturated end)
    assert eff[0] < eff[1] < eff[2] and eff[3] > eff[2] - 0.03, eff
    assert eff[2] - eff[0] > 0.15
    streaks = [held_depth_run("random_item", d, sampler).max_bucket_streak for d in (4, 90)]
    assert streaks[0] > streaks[1]


def test_proportional_beats_fullest_and_random_item(sampler: Sampler) -> None:
    for depth in (4, 10, 30, 90):
        prop = held_depth_run("proportional", depth, sampler).mix_efficiency
        assert prop > held_depth_run("random_item", depth, sampler).mix_efficiency
        assert prop > held_depth_run("fullest", depth, sampler).mix_efficiency
    assert held_depth_run("proportional", 30, sampler).mix_efficiency > 1.0  # stratified beats i.i.d.


@pytest.mark.parametrize("p", [[0.024, 0.030, 0.102, 0.161, 0.683], [0.5, 0.5], [0.2] * 5])
def test_iid_draws_from_p_score_one_within_sampling_error(p: list[float]) -> None:
    rng = random.Random(11)
    n = 200 * W
    buckets = rng.choices(range(len(p)), weights=p, k=n)
    m = mix_metrics(buckets, [float(b) for b in buckets], buckets, p, window=W)
    se = m.efficiency_standard_error()
    assert abs(m.mix_efficiency - 1.0) < 4 * se, (m.mix_efficiency, se)
    assert abs(m.length_autocorr) < 4 / math.sqrt(n)


def test_expected_entropy_matches_monte_carlo() -> None:
    p = [0.1, 0.2, 0.7]
    rng = random.Random(0)
    hs = []
    for _ in range(20000):
        c = [0, 0, 0]
        for b in rng.choices(range(3), weights=p, k=W):
            c[b] += 1
        hs.append(-sum((x / W) * math.log(x / W) for x in c if x))
    mc = sum(hs) / len(hs)
    assert abs(expected_window_entropy(p, W) - mc) < 0.005
