"""Mix metrics on hand-computable take logs."""

from __future__ import annotations

import math

import pytest

from dflash.core.mixmetrics import (
    entropy,
    expected_window_entropy,
    kl_to_mix,
    lag1_autocorr,
    max_bucket_streak,
    mix_metrics,
    window_counts,
)


def test_windows_are_consecutive_non_overlapping_and_drop_the_tail() -> None:
    assert window_counts([0, 1, 1, 0, 1, 1, 0], 3, 2) == [[1, 2], [1, 2]]


def test_entropy_of_uniform_two_buckets_is_log2() -> None:
    assert entropy([4, 4]) == pytest.approx(math.log(2))
    assert entropy([8, 0]) == 0.0


def test_expected_entropy_edge_cases() -> None:
    assert expected_window_entropy([1.0, 0.0], 8) == 0.0
    # W=2, p=(.5,.5): H=log2 with prob 1/2, else 0
    assert expected_window_entropy([0.5, 0.5], 2) == pytest.approx(0.5 * math.log(2))


def test_kl_is_zero_only_near_the_mix_and_finite_for_absent_buckets() -> None:
    assert kl_to_mix([50, 50], [0.5, 0.5]) == pytest.approx(0.0)
    assert math.isfinite(kl_to_mix([10, 0], [0.5, 0.5]))
    assert kl_to_mix([10, 0], [0.5, 0.5]) > kl_to_mix([6, 4], [0.5, 0.5])


@pytest.mark.parametrize(("xs", "sign"), [([1, 1, 2, 2, 1, 1, 2, 2, 1, 1], 1), ([1, 2] * 10, -1)])
def test_lag1_autocorrelation_sign(xs: list[int], sign: int) -> None:
    assert math.copysign(1, lag1_autocorr(xs)) == sign
    assert math.isnan(lag1_autocorr([3, 3, 3]))


def test_max_bucket_streak_counts_takes_in_the_first_thousand() -> None:
    assert max_bucket_streak([0, 0, 1, 1, 1, 0]) == (3, 6)
    assert max_bucket_streak([0] * 1500 + [1]) == (1000, 1000)


def test_perfectly_alternating_takes_beat_iid_efficiency() -> None:
    buckets = [0, 1] * 320
    m = mix_metrics(buckets, buckets, buckets, [0.5, 0.5], window=32)
    assert m.mix_entropy == pytest.approx(1.0)
    assert m.mix_efficiency > 1.0 and m.length_autocorr == pytest.approx(-1.0, abs=0.01)


def test_one_bucket_streams_score_zero_efficiency() -> None:
    buckets = [0] * 320 + [1] * 320
    m = mix_metrics(buckets, buckets, buckets, [0.5, 0.5], window=32)
    assert m.mix_efficiency == 0.0 and m.n_windows == 20 and m.max_bucket_streak == 320


def test_loss_roughness_is_the_std_of_first_differences_over_the_mean_on_the_stated_span() -> None:
    from dflash.core.runmetrics import loss_roughness

    smooth = loss_roughness([4.0, 3.9, 3.8, 3.7, 3.6])
    saw = loss_roughness([4.0, 3.0, 4.0, 3.0, 4.0])
    assert smooth["loss_roughness"] == pytest.approx(0.0, abs=1e-12)
    assert saw["loss_roughness"] == pytest.approx(math.sqrt(4 / 3) / 3.6)  # diffs -1,+1,-1,+1
    assert loss_roughness([1.0, None, float("nan"), 2.0])["loss_roughness"] is None
    assert loss_roughness([5.0] * 10, first_step=4)["loss_roughness_steps"] == [4, 9]
