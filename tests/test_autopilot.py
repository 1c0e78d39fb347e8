"""The queue autopilot (dflash/core/autopilot.py) as a specification.

The controller is driven here by a real QueueCore fed pure arrival sequences, the way the simulator
and the coordinator drive it: observe_put per put, observe_take then decide per take, and
QueueCore.reconfigure with each decision before the next take. The simulator tests at the end run
the whole SimPy pipeline with [queue] mode = "auto".
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

from dflash.core.autopilot import (
    STEP_DOWN,
    STEP_UP,
    Autopilot,
    AutopilotConfig,
    AutopilotTuning,
    QueueState,
    ShadowBuffer,
    ladder,
    window_stride,
)
from dflash.core.config import QueueConfig, load_config, with_overrides
from dflash.core.errors import ConfigError
from dflash.core.mixmetrics import expected_window_entropy
from dflash.core.queue_core import QueueCore, QueueItem

MIX = [0.4, 0.3, 0.2, 0.1]


def iid_arrivals(n: int, seed: int = 0, mix: list[float] = MIX) -> list[int]:
    rng = random.Random(seed)
    return rng.choices(range(len(mix)), weights=mix, k=n)


def grouped_arrivals(n: int, run: int, seed: int = 0, mix: list[float] = MIX) -> list[int]:
    """Runs of ``run`` items of one bucket (a length-grouped loader's sawtooth, coarsened)."""
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < n:
        out += [rng.choices(range(len(mix)), weights=mix)[0]] * run
    return out[:n]


def drive(autopilot: Autopilot, config: QueueConfig, arrivals: list[int], *, drafter_bound: bool = False,
          nbytes: int = 100) -> tuple[QueueCore, list]:
    """One take per arrival, as a target-bound queue does (drafters waiting at the gate; wait 1 s per
    take), or, ``drafter_bound``, producers blocked 1 s per put and drafters never waiting."""
    core = QueueCore(config, len(MIX), mix=MIX, seed=1)
    decisions = []
    for k, b in enumerate(arrivals):
        t = float(k)
        core.put(QueueItem(f"i{k}", b, nbytes=nbytes), t)
        autopilot.observe_put(t, b, nbytes, 1.0 if drafter_bound else 0.0)
        while core.gate() is not None:
            bucket, items = core.take(t)
            autopilot.observe_take(t, bucket, len(items), 0.0 if drafter_bound else 1.0)
            d = autopilot.decide(t, QueueState(core.depth, core.queued_bytes))
            if d is not None:
                core.reconfigure(d.config)
                decisions.append(d)
            if drafter_bound and core.depth < core.config.max_depth:
                break  # a drafter-bound queue sits full: one take per put
    return core, decisions


def knob_path(start: int, decisions: list, key: str = "min_ready") -> list[int]:
    path = [start]
    for d in decisions:
        path.append(getattr(d.config, key))
    return path


# ---------------------------------------------------------------------------- configuration
def test_queue_config_validates_the_auto_keys():
    cfg = QueueConfig(mode="auto", target_mix_efficiency=0.9, auto_min_ready=2, auto_max_depth=120)
    assert cfg.depth_limit == 120
    assert QueueConfig().mode == "static" and QueueConfig().depth_limit == 90
    for bad, key in (({"mode": "autopilot"}, "queue.mode"),
                     ({"target_mix_efficiency": 0.0}, "queue.target_mix_efficiency"),
                     ({"auto_min_ready": 31}, "queue.auto_min_ready"),
                     ({"auto_max_depth": 80}, "queue.auto_max_depth")):
        with pytest.raises(ConfigError) as err:
            QueueConfig(**bad)
        assert key in str(err.value)


def test_the_examples_take_mode_auto_from_flags():
    cfg = with_overrides(load_config("examples/h200-target-bound.toml"), {"queue.mode": "auto"})
    assert cfg.queue.mode == "auto" and cfg.queue.target_mix_efficiency == 0.95


# ---------------------------------------------------------------------------- building blocks
def test_ladder_covers_the_limits_in_steps_of_about_a_fifth():
    sizes = ladder(1, 90)
    assert sizes[0] == 1 and sizes[-1] == 90 and sizes == sorted(set(sizes))
    assert sizes[:6] == [1, 2, 3, 4, 5, 6]
    assert all(b / a <= 1.25 for a, b in itertools.pairwise(sizes[5:]))
    assert ladder(7, 7) == [7]


def test_a_bigger_shadow_buffer_mixes_grouped_arrivals_better():
    arrivals = grouped_arrivals(6000, run=16)
    eh = expected_window_entropy(MIX, 32)
    means = []
    for size in (2, 16, 64):
        sh = ShadowBuffer(size, "random_item", MIX, 32, 1000, eh, seed=3)
        for b in arrivals:
            sh.arrive(b)
        means.append(sh.interval(0.0)[0])
    assert means[0] < means[1] < means[2]
    assert means[0] < 0.6 and means[2] > 0.85


def sorted_mega_batches(n: int, mega: int = 64, seed: int = 0) -> list[int]:
    """A length-grouped loader's order: mega-batches of ``mega`` i.i.d. items, each sorted (a sawtooth)."""
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < n:
        out += sorted(rng.choices(range(len(MIX)), weights=MIX, k=mega))
    return out[:n]


def test_a_shadow_judges_every_tiling_so_where_its_windows_start_does_not_move_its_mix():
    """Mega-batches of 2 W sorted items: the mix of one tiling into windows of W depends on where the
    tiling starts (a run's metric starts it at warmup_s); the mean over PHASES tilings does not, and it
    is the single tilings' mean. The lower end sits below the mean by a share of the worst tiling's gap."""
    arrivals = sorted_mega_batches(64 * 60)
    eh = expected_window_entropy(MIX, 32)
    by_phases: dict[int, list[tuple[float, float]]] = {}
    for phases in (1, 4):
        for offset in range(0, 32, 4):  # the same arrivals, the tilings starting 0..28 takes later
            sh = ShadowBuffer(8, "random_item", MIX, 32, 1000, eh, seed=3, phases=phases)
            for b in arrivals[offset:]:
                sh.arrive(b)
            by_phases.setdefault(phases, []).append(sh.interval(0.0))
    one = [m for m, _ in by_phases[1]]
    four = [m for m, _ in by_phases[4]]
    assert max(one) - min(one) > 0.04  # one tiling: 0.804..0.861 measured
    assert max(four) - min(four) < (max(one) - min(one)) / 4  # four tilings: 0.834..0.841
    assert abs(sum(four) / len(four) - sum(one) / len(one)) < 0.01
    assert all(lo < m for m, lo in by_phases[4]) and all(lo == m for m, lo in by_phases[1])
    assert window_stride(32, 4) == 8 and window_stride(2, 4) == 1 and window_stride(30, 4) == 6


# ---------------------------------------------------------------------------- the controller
def test_no_decision_before_the_first_windows_and_none_from_the_clock():
    cfg = QueueConfig(min_ready=10, max_depth=30, mode="auto")
    ap = Autopilot(AutopilotConfig(cfg, MIX, tuning=AutopilotTuning(first_windows=16)))
    _, decisions = drive(ap, cfg, iid_arrivals(16 * 32 - 1))
    assert decisions == []


def test_well_mixed_arrivals_lower_the_knob_to_its_floor_at_the_stated_rate():
    cfg = QueueConfig(min_ready=30, max_depth=90, mode="auto", auto_min_ready=3)
    ap = Autopilot(AutopilotConfig(cfg, MIX, seed=0))
    core, decisions = drive(ap, cfg, iid_arrivals(8000))
    path = knob_path(30, decisions)
    assert path[-1] == 3, "iid arrivals mix at any size: the least memory is the floor"
    assert min(path) >= 3
    for a, b in itertools.pairwise(path):
        assert b < a  # only down
        assert b >= min(a - 1, math.floor(a * (1 - STEP_DOWN)))  # never faster than STEP_DOWN
    assert all(d.config.max_depth == 3 * d.config.min_ready for d in decisions)  # the configured ratio
    assert core.config.min_ready == 3


def test_grouped_arrivals_raise_the_knob_never_past_the_depth_limit_nor_faster_than_step_up():
    cfg = QueueConfig(min_ready=2, max_depth=6, mode="auto", auto_max_depth=40)
    ap = Autopilot(AutopilotConfig(cfg, MIX, seed=0))
    _, decisions = drive(ap, cfg, grouped_arrivals(12000, run=64))
    path = knob_path(2, decisions)
    assert max(path) > 2
    assert all(d.config.max_depth <= 40 and d.config.min_ready <= d.config.max_depth for d in decisions)
    for a, b in itertools.pairwise(path):
        if b > a:
            assert b <= max(a + 1, math.ceil(a * (1 + STEP_UP)))


def test_byte_limit_caps_the_depth():
    cfg = QueueConfig(min_ready=4, max_depth=12, max_bytes=2000, mode="auto", auto_max_depth=200)
    ap = Autopilot(AutopilotConfig(cfg, MIX, seed=0))
    _, decisions = drive(ap, cfg, grouped_arrivals(12000, run=64), nbytes=100)
    assert decisions, "grouped arrivals must move the knob"
    assert all(d.config.min_ready * 100 <= 2000 for d in decisions)
    assert max(d.config.min_ready for d in decisions) == 20


@pytest.mark.parametrize("seed", [0, 3])
def test_a_steady_input_settles_without_oscillating(seed):
    """On a stationary input the knob converges and then only tracks the estimate's noise: the
    second half's median is the first half's (within 1.5x), it never leaves [median/3, 3 x median],
    and it turns round at fewer than 40% of its changes (a limit cycle turns round at every one).
    The wander is real: where the mix curve is flat near the target, +/-0.01 of estimated mix moves
    the size needed by +/-50% (measured here: 11..72 around a median of 25..36)."""
    cfg = QueueConfig(min_ready=40, max_depth=120, mode="auto")
    ap = Autopilot(AutopilotConfig(cfg, MIX, seed=0))
    _, decisions = drive(ap, cfg, grouped_arrivals(40000, run=4, seed=seed))
    first = [d.config.min_ready for d in decisions if 10000 <= d.t < 20000]
    second = [d.config.min_ready for d in decisions if d.t >= 20000]
    median = sorted(second)[len(second) // 2]
    first_median = sorted(first)[len(first) // 2]
    assert first_median / 1.5 <= median <= first_median * 1.5, (first_median, median)
    assert median / 3 <= min(second) and max(second) <= 3 * median, second
    turns = sum(1 for a, b, c in zip(second, second[1:], second[2:], strict=False) if (b - a) * (c - b) < 0)
    assert turns < 0.4 * len(second), (turns, len(second))


def test_drafter_bound_moves_max_depth_and_says_min_ready_does_not_bind():
    cfg = QueueConfig(min_ready=30, max_depth=90, mode="auto")
    ap = Autopilot(AutopilotConfig(cfg, MIX, seed=0))
    _, decisions = drive(ap, cfg, iid_arrivals(8000), drafter_bound=True)
    assert decisions
    first = decisions[0]
    assert first.reason["bound"] == "drafter" and first.reason["knob"] == "max_depth"
    assert first.reason["min_ready_binds"] is False
    assert all(d.config.min_ready <= d.config.max_depth for d in decisions)
    assert decisions[-1].config.max_depth < 90


def test_a_decision_is_a_control_record_with_its_reason():
    cfg = QueueConfig(min_ready=30, max_depth=90, mode="auto")
    ap = Autopilot(AutopilotConfig(cfg, MIX, seed=0))
    _, decisions = drive(ap, cfg, iid_arrivals(3000))
    rec = decisions[0].record()
    assert rec["accepted"] is True and set(rec["change"]) <= {"min_ready", "max_depth"}
    reason = rec["reason"]
    for key in ("mix_efficiency", "interval", "arrival_items_per_s", "drafter_gate_wait_frac",
                "producer_blocked_frac", "rule", "size_needed", "from"):
        assert key in reason
    lo, hi = reason["interval"]
    assert lo <= reason["mix_efficiency"] <= hi
    assert len(reason["arrival_items_per_s"]) == len(MIX)


def test_same_calls_same_decisions():
    cfg = QueueConfig(min_ready=20, max_depth=60, mode="auto")
    runs = [drive(Autopilot(AutopilotConfig(cfg, MIX, seed=4)), cfg, grouped_arrivals(6000, run=12))[1]
            for _ in range(2)]
    assert [(d.t, d.change) for d in runs[0]] == [(d.t, d.change) for d in runs[1]]


def test_state_survives_a_resume_as_json():
    import json

    cfg = QueueConfig(min_ready=30, max_depth=90, mode="auto")
    ap = Autopilot(AutopilotConfig(cfg, MIX, seed=0))
    core, decisions = drive(ap, cfg, iid_arrivals(3000))
    assert decisions
    state = json.loads(json.dumps(ap.state_dict()))
    again = Autopilot(AutopilotConfig(cfg, MIX, seed=0))
    again.load_state_dict(state)
    assert again.config == ap.config == core.config
    assert again.interval() == ap.interval() and again.smoothed == ap.smoothed


@pytest.mark.parametrize(("flags", "needles"), [
    (["--queue", "autopilot"], ["queue.mode", "--queue", "static, auto"]),
    (["--target-mix", "0"], ["queue.target_mix_efficiency", "--target-mix"]),
    (["--target-mix", "2"], ["queue.target_mix_efficiency", "--target-mix"]),
    (["--target-mix", "high"], ["queue.target_mix_efficiency", "--target-mix"]),
])
def test_bad_autopilot_flags_are_one_line_exit_2(flags, needles, capsys):
    from dflash.cli import main

    assert main(["simulate", "--config", "examples/h200-target-bound.toml", "--sim-seconds", "10", *flags]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and all(n in lines[0] for n in needles), lines
