"""The learning-rate schedule follows the way the run ends (dflash/core/schedule.py)."""

from __future__ import annotations

import pytest

from dflash.core.errors import ConfigError
from dflash.core.schedule import Schedule, schedule_for


def test_step_limited_warmup_counts_steps_like_the_old_schedule():
    s = Schedule("cosine", total_steps=100, warmup_ratio=0.1)
    assert [s.factor(k, 0.0) for k in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert s.factor(10, 0.0) == pytest.approx(1.0)
    assert s.factor(55, 0.0) == pytest.approx(0.5)
    assert 0 < s.factor(99, 0.0) < 0.01


@pytest.mark.parametrize("shape", ["cosine", "wsd"])
def test_time_budget_holds_in_the_middle_and_decays_at_the_end(shape):
    """A --max-minutes 3 run with a stub clock: >= 0.8 of peak through its middle (wsd), < 0.3 at the end."""
    s = Schedule(shape, budget_s=180.0, warmup_ratio=0.04, decay_frac=0.2)
    clock = [i * 0.9 for i in range(200)]  # one step per 0.9 s of training time
    lrs = [s.factor(k, t) for k, t in enumerate(clock)]
    assert all(f > 0 for f in lrs)
    assert lrs[-1] < 0.3
    middle = lrs[60:140]  # 54-126 s
    if shape == "wsd":
        assert min(middle) >= 0.8
    else:
        assert max(middle) <= 1.0 and lrs[60] > lrs[139]


def test_whichever_limit_comes_first_decides():
    s = Schedule("wsd", total_steps=1000, budget_s=100.0, decay_frac=0.5, warmup_ratio=0.0)
    assert s.progress(10, 90.0) == pytest.approx(0.9)  # time is nearer its end
    assert s.progress(900, 10.0) == pytest.approx(0.9)  # steps are
    assert s.factor(10, 90.0) == pytest.approx(0.2)


def test_never_zero_before_the_end_of_a_long_step_run():
    """The old default assumed 1,000 steps and sat at 0 after them; a 5,000-step run learns to its end."""
    s = schedule_for(shape="wsd", max_steps=5000, schedule_steps=None, max_minutes=None, warmup_ratio=0.04,
                     decay_frac=0.2, min_ratio=0.0)
    assert all(s.factor(k, 0.0) > 0 for k in range(0, 5000, 7))
    assert s.factor(1500, 0.0) == 1.0


def test_resume_continues_exactly_from_its_state():
    s = Schedule("wsd", total_steps=50, budget_s=60.0)
    again = Schedule.from_state(s.state_dict())
    assert [again.factor(k, k * 1.3) for k in range(50)] == [s.factor(k, k * 1.3) for k in range(50)]


def test_extension_starts_a_new_phase_that_decays_at_its_own_end():
    s = Schedule("wsd", total_steps=100, warmup_ratio=0.05)
    assert s.factor(99, 0.0) == pytest.approx(0.05)  # the last step: one step's share of the decay
    ext = s.extended(100, 50.0, total_steps=200, budget_s=None)
    assert ext.start_step == 100 and ext.factor(100, 50.0) < 1.0  # a short re-warm-up, not a jump
    assert ext.factor(150, 70.0) == 1.0 and ext.factor(199, 90.0) == pytest.approx(0.05)


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"shape": "linear", "total_steps": 10}, "train.schedule"),
    ({"total_steps": 10, "decay_frac": 0.0}, "train.decay_frac"),
    ({"total_steps": 10, "warmup_ratio": 0.9}, "train.warmup_ratio"),
    ({"total_steps": 10, "min_ratio": 1.5}, "train.min_lr_ratio"),
])
def test_bad_schedules_name_their_key(kwargs, key):
    with pytest.raises(ConfigError) as err:
        Schedule(**kwargs)
    assert err.value.key == key


def test_a_schedule_ending_before_the_run_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        schedule_for(shape="cosine", max_steps=500, schedule_steps=300, max_minutes=None, warmup_ratio=0.04,
                     decay_frac=0.2, min_ratio=0.0)
    assert err.value.key == "train.schedule_steps"


def test_open_ended_run_warms_up_then_holds_the_peak():
    """No step limit, no time budget (the run ends with its data or a signal): never a decay to 0."""
    from dflash.core.schedule import OPEN_WARMUP_STEPS

    s = Schedule("wsd", total_steps=None, budget_s=None)
    assert 0 < s.factor(0, 0.0) < s.factor(OPEN_WARMUP_STEPS // 2, 1.0) < 1.0
    assert s.factor(OPEN_WARMUP_STEPS, 10.0) == 1.0 and s.factor(10**6, 10**6) == 1.0
