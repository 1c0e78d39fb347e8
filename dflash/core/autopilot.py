"""The queue autopilot: min_ready and max_depth moved between takes to hold a mix goal cheaply.

What it decides: with ``[queue] mode = "auto"``, after a take, whether to change ``min_ready`` and
``max_depth`` (never the policy, gate or items per take), so that the rolling ``mix_efficiency``
stays at or above ``target_mix_efficiency`` with the least queued memory, and the bottleneck
stage loses at most ``MAX_LOSS`` of its time to the queue. Every decision comes with its reason:
the measured mix and its interval, the bucket arrival rates, the gate wait and cap block shares,
the mix each buffer size would give, and the rule that fired.

One knob at a time: the queue mixes as a buffer of the items it holds, and which knob sets that
buffer depends on the bottleneck. Target-bound (drafters wait at the gate more than producers
block at the cap) the queue hovers at ``min_ready``: that is the knob, and ``max_depth`` follows
at the configured ratio (it bounds bursts; it opens further if producers lose time at the cap).
Drafter-bound the queue sits at ``max_depth``: that is the knob, ``min_ready`` does not bind (the
reason says so) and is only kept at or below ``max_depth``; drafters waiting at the gate more than
``MAX_LOSS`` of their time raise it.

Which size: the measured mix of the one size in use cannot say whether a smaller one would do,
and its window-to-window spread is large (std ~0.25 at W = 32), mostly from the arrival order. So
the autopilot feeds the real arrivals to :class:`ShadowBuffer` s of every size on a ladder, each
taking with the run's own policy, and picks the smallest size whose rolling mix over the last
``HORIZON_WINDOWS`` windows meets the target. All sizes see the same arrivals, so their
differences are the size's. Each shadow closes a window every W / ``PHASES`` takes, so each size is
judged over every way of tiling its takes into windows (a run's metric tiles from wherever its span
starts, and on length-grouped arrivals that start alone moves the mix by +/-0.03): the mean over the
tilings, less ``PHASE_MARGIN`` of its gap to the worst one (:func:`shadow_interval`).

How it starts and how fast it moves: from the configured pair, first after ``FIRST_WINDOWS``
windows. It decides at most once every ``PERIOD_WINDOWS`` new windows of the queue's takes; a
decision moves the knob by at most ``STEP_UP`` (up) or ``STEP_DOWN`` (down) of its value (at least
one item), and lowers only when the size needed is ``DEAD_BAND`` below the knob, so a steady input
settles instead of oscillating (tests/test_autopilot.py).

What it never does: read a clock (callers pass the time in), block, touch the queue's contents, or
go outside its limits: ``auto_min_ready`` <= min_ready, max_depth <= ``auto_max_depth`` (the
configured max_depth by default), and queued bytes within ``max_bytes`` and the memory budget
given to it. It is pure and torch-free like :class:`dflash.core.queue_core.QueueCore`. The caller
(the simulator here; the trainer's coordinator the same way) calls ``observe_put`` for each put,
``observe_take`` then ``decide`` for each take, in the queue's order, and applies a decision's
config with ``QueueCore.reconfigure`` before the next take, writing ``Decision.record()`` as a
control record.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dflash.core.config import DflashConfig, QueueConfig
from dflash.core.mixmetrics import entropy, expected_window_entropy
from dflash.core.policies import NO_HEAD, make_policy

STEP_UP = 0.15  # the most one decision raises a knob, as a share of its value (at least one item)
STEP_DOWN = 0.10  # the most one decision lowers it: slower than up, so noise cannot walk it down
MAX_LOSS = 0.01  # the bottleneck's time the queue may cost (gate wait or cap block beyond the cheapest)
HORIZON_WINDOWS = 96  # mix windows in the rolling interval (3,072 items at W = 32)
PERIOD_WINDOWS = 4  # new mix windows between two decisions
FIRST_WINDOWS = 16  # windows every size's shadow has seen before the first decision (512 items at W = 32)
REPLICAS = 2  # shadow buffers per size (their windows are pooled)
MARGIN = 0.0  # the set point: target + MARGIN
DEAD_BAND = 0.05  # lower only when the size needed is this share (at least one item) below the knob
SMOOTH = 0.5  # weight of the newest estimate of the size needed (in log space) at each decision
PLATEAU = 0.02  # when no size meets the target: the smallest this close to the best mix (more buys little)
# The shadows' windows end every W / PHASES takes, so each size is judged over PHASES tilings of its takes
# (shadow_interval says why); PHASE_MARGIN of the gap between the mean and the worst tiling is the margin.
# On the target-bound example (packaged ShareGPT, seeds 0-5) a margin of 0 let one seed's run mix fall to
# 0.937, and 1 (the worst tiling) cost as much memory as one tiling per shadow (RESULTS.md).
PHASES = 4
PHASE_MARGIN = 0.25
# The shadows' interval, mean - Z standard errors, is what must meet the target. Z = 0.5 cost
# 4-56% more queue memory on the target-bound example (5 seeds) for a run mix already >= 0.95 at
# Z = 0: window efficiencies are correlated over a mega-batch, so their standard error says little.
Z = 0.0


@dataclass(frozen=True)
class QueueState:
    """What the queue holds between takes (as the caller reads it from its QueueCore)."""

    depth: int
    queued_bytes: int
    blocked_producers: int = 0


@dataclass(frozen=True)
class Decision:
    """A change of the knobs and why: ``config`` is applied with ``QueueCore.reconfigure``."""

    t: float
    config: QueueConfig
    change: dict[str, int]
    reason: dict[str, Any]

    def record(self) -> dict[str, Any]:
        """The control record's fields (docs/ARCHITECTURE.md records: kind ``control``)."""
        return {"t": self.t, "accepted": True, "change": self.change, "source_of_change": "autopilot",
                "reason": self.reason}


def ladder(lo: int, hi: int) -> list[int]:
    """Buffer sizes the autopilot weighs: every size up to 6, then about 20% apart, lo..hi inclusive."""
    sizes: list[int] = []
    k = max(1, lo)
    while k < hi:
        sizes.append(k)
        k = k + 1 if k < 6 else max(k + 1, round(k * 1.2))
    sizes.append(max(hi, lo))
    return sizes


class ShadowBuffer:
    """A buffer of ``size`` items fed the queue's real arrivals, taking one item per arrival with the
    run's policy once it holds ``size``: the order the queue would take in at that size.

    Why: the window-to-window spread of the mix is large (std ~0.25 of the efficiency at W = 32 on
    the H200 example), and most of it comes from the arrival order, so the measured mix of the one
    size in use cannot say which smaller size would still do. All shadows see the same arrivals, so
    their differences are the size's, not the noise's. Pure counts: no items, no bytes, no clock.
    """

    __slots__ = ("by_phase", "counts", "depth", "expected_h", "heads", "last", "log_w", "n_taken", "policy", "rng",
                 "seq", "size", "stride", "taken", "window", "xlogx")

    def __init__(self, size: int, policy_name: str, mix: Sequence[float], window: int, horizon: int,
                 expected_h: float, seed: int, phases: int = 1) -> None:
        self.size = size
        self.policy = make_policy(policy_name, len(mix), mix)
        self.rng = random.Random(seed)
        self.counts = [0] * len(mix)
        self.heads: list[deque[int]] = [deque() for _ in mix]
        self.depth = self.seq = 0
        self.window, self.expected_h = window, expected_h
        self.stride = window_stride(window, phases)  # takes between two window ends
        self.last = [-1] * window  # the buckets of the last ``window`` takes, a ring (-1: none yet)
        self.taken = [0] * len(mix)  # their counts
        self.n_taken = 0
        self.xlogx, self.log_w = _xlogx(window), math.log(window)
        # the windows of each phase (window ends k, k + n, k + 2n, ... for n phases): each phase tiles the
        # takes into consecutive windows, as a run's metric tiles them from wherever its span starts
        self.by_phase: list[deque[float]] = [deque(maxlen=horizon) for _ in range(window // self.stride)]

    def arrive(self, bucket: int) -> None:
        self.counts[bucket] += 1
        policy = self.policy
        needs_heads = policy.needs_heads  # arrival numbers only for the policies that read the oldest items
        if needs_heads:
            self.heads[bucket].append(self.seq)
            self.seq += 1
        self.depth += 1
        if self.depth < self.size:
            return
        heads = [q[0] if q else NO_HEAD for q in self.heads] if needs_heads else ()
        b = policy.choose(self.counts, heads, self.depth, self.rng)
        self.counts[b] -= 1
        if needs_heads:
            self.heads[b].popleft()
        self.depth -= 1
        if policy.stateful:
            policy.on_take(b, 1)
        last, taken, n = self.last, self.taken, self.n_taken
        slot = n % self.window
        old = last[slot]
        if old >= 0:
            taken[old] -= 1
        last[slot] = b
        taken[b] += 1
        self.n_taken = n = n + 1
        if n % self.stride == 0 and n >= self.window:  # a window ends: its phase is its end's place in W
            xlogx = self.xlogx  # H = ln W - sum(c ln c) / W, from a table: this runs every W / PHASES takes
            h = self.log_w - sum([xlogx[c] for c in taken]) / self.window
            by_phase = self.by_phase
            by_phase[n // self.stride % len(by_phase)].append(h / self.expected_h)

    @property
    def windows(self) -> int:
        """Windows of takes in the rolling record (the first phase's, which leads)."""
        return len(self.by_phase[0])

    def interval(self, z: float) -> tuple[float, float]:
        """(mean, lower end) of this size's rolling mix_efficiency (:func:`shadow_interval`)."""
        return shadow_interval([self], z)


@functools.cache
def _xlogx(window: int) -> tuple[float, ...]:
    """c ln c for c = 0..window (0 ln 0 = 0)."""
    return tuple(c * math.log(c) if c else 0.0 for c in range(window + 1))


def window_stride(window: int, phases: int) -> int:
    """Takes between two window ends of a shadow: the largest divisor of ``window`` at most window / phases,
    so the window ends fall into ``window // stride`` phases that each tile the takes exactly."""
    target = max(1, window // max(1, phases))
    return max(d for d in range(1, target + 1) if window % d == 0)


def shadow_interval(replicas: Sequence[ShadowBuffer], z: float, phase_margin: float = PHASE_MARGIN
                    ) -> tuple[float, float]:
    """(mean, lower end) of one size's rolling mix_efficiency over its replicas' windows: the mean over every
    tiling, and as the lower end that mean less ``phase_margin`` of its gap to the worst tiling's mean, less
    ``z`` standard errors of one tiling's windows.

    Why tilings: a run's metric tiles its takes into consecutive windows from wherever its span starts
    (``[metrics] warmup_s``), and where the arrivals have a period near the window (a length-grouped
    loader's mega-batch of 2 W items) that start alone moves the measured mix: on the H200 target-bound
    example 15/45 reads 0.904 to 0.971 on seed 0 as warmup_s moves over 568..628 s, 0.940 on average
    (benchmarks/window_phase.py). With one tiling per shadow each size is judged at its own phase (a
    shadow of size k tiles from arrival k), so the sizes' mixes zigzag by the phase, not the size. The
    controller cannot know the metric's start, so it aims at the mean over tilings, with a margin
    measured from their spread.
    """
    n_phases = len(replicas[0].by_phase)
    totals, counts = [0.0] * n_phases, [0] * n_phases
    for sh in replicas:
        for p, q in enumerate(sh.by_phase):
            totals[p] += sum(q)
            counts[p] += len(q)
    if min(counts) < 2:
        return math.nan, math.nan
    phase_means = [t / c for t, c in zip(totals, counts, strict=True)]
    mean = sum(phase_means) / n_phases
    lower = mean - phase_margin * (mean - min(phase_means))
    if z:
        one_mean, one_lower = _interval([e for sh in replicas for e in sh.by_phase[0]], z)
        lower -= one_mean - one_lower
    return mean, lower


def _interval(values: Sequence[float], z: float) -> tuple[float, float]:
    effs = [e for e in values if math.isfinite(e)]
    n = len(effs)
    if n < 2:
        return math.nan, math.nan
    mean = sum(effs) / n
    se = math.sqrt(sum((e - mean) ** 2 for e in effs) / (n - 1) / n)
    return mean, mean - z * se


@dataclass(frozen=True)
class AutopilotTuning:
    """The controller's own constants (the module constants above say why each is what it is); a test
    may vary one, a run never does."""

    horizon_windows: int = HORIZON_WINDOWS
    period_windows: int = PERIOD_WINDOWS
    replicas: int = REPLICAS
    step_up: float = STEP_UP
    step_down: float = STEP_DOWN
    z: float = Z
    margin: float = MARGIN
    max_loss: float = MAX_LOSS
    first_windows: int = FIRST_WINDOWS
    dead_band: float = DEAD_BAND
    smooth: float = SMOOTH
    plateau: float = PLATEAU
    phases: int = PHASES
    phase_margin: float = PHASE_MARGIN

    def __post_init__(self) -> None:
        if self.horizon_windows < 2 or self.period_windows < 1 or self.replicas < 1 or self.phases < 1:
            raise ValueError("horizon_windows must be >= 2, period_windows, replicas and phases >= 1")
        if not 0 < self.step_down <= self.step_up:
            raise ValueError("need 0 < step_down <= step_up")


@dataclass(frozen=True)
class AutopilotConfig:
    """What the controller is told about the run it steers.

    ``queue`` the starting knobs and their bounds, ``mix`` the item mix p (for the expected window
    entropy), ``window`` the metrics window W, ``n_target``/``n_drafter`` the workers (for time shares),
    ``memory_bytes`` an optional byte budget for queued hidden states (with ``max_bytes``, the tighter one
    holds), ``seed`` seeds the shadow buffers' policy draws. :meth:`for_run` is the one way a run (the
    simulator, the coordinator) builds it, so both steer with the same facts."""

    queue: QueueConfig
    mix: Sequence[float]
    window: int = 32
    n_target: int = 1
    n_drafter: int = 1
    memory_bytes: int | None = None
    seed: int = 0
    tuning: AutopilotTuning = AutopilotTuning()

    def __post_init__(self) -> None:
        if self.window < 2:
            raise ValueError("window must be >= 2")

    @classmethod
    def for_run(cls, cfg: DflashConfig, mix: Sequence[float], n_target: int, n_drafter: int,
                queue: QueueConfig | None = None) -> AutopilotConfig:
        """A run's autopilot: its queue (or ``queue``, the knobs in force), window, budget and seed."""
        return cls(queue or cfg.queue, tuple(mix), window=cfg.metrics.window, n_target=n_target, n_drafter=n_drafter,
                   memory_bytes=queue_memory_budget(cfg.sweep.memory_budget_gib), seed=cfg.seed)


class Autopilot:
    """Feed it puts and takes in order; ask :meth:`decide` between takes (see :class:`AutopilotConfig`)."""

    def __init__(self, setting: AutopilotConfig) -> None:
        config, mix, window, seed = setting.queue, setting.mix, setting.window, setting.seed
        n_target, n_drafter, memory_bytes = setting.n_target, setting.n_drafter, setting.memory_bytes
        tune = setting.tuning
        horizon_windows, replicas = tune.horizon_windows, tune.replicas
        self.target = config.target_mix_efficiency
        self.limit_depth = config.depth_limit
        self.floor_ready = config.auto_min_ready
        self.ratio = config.max_depth / config.min_ready  # max_depth follows min_ready at this ratio
        self.config = dataclasses.replace(config, auto_max_depth=self.limit_depth)
        self.mix = list(mix)
        self.window = window
        self.expected_h = expected_window_entropy(self.mix, window)
        self.n_target, self.n_drafter = n_target, n_drafter
        byte_caps = [b for b in (config.max_bytes, memory_bytes) if b is not None]
        self.byte_limit = min(byte_caps) if byte_caps else None
        self.horizon, self.period, self.first_windows = horizon_windows, tune.period_windows, tune.first_windows
        self.dead_band, self.smooth, self.plateau = tune.dead_band, tune.smooth, tune.plateau
        self.phase_margin = tune.phase_margin
        self.smoothed: float | None = None  # log of the size needed, smoothed over decisions
        self.step_up, self.step_down, self.z = tune.step_up, tune.step_down, tune.z
        self.margin, self.max_loss = tune.margin, tune.max_loss
        self.sizes = ladder(self.floor_ready, self.limit_depth)
        rng = random.Random(seed)
        self.shadows = [[ShadowBuffer(size, config.policy, self.mix, window, horizon_windows, self.expected_h,
                                      rng.getrandbits(32), tune.phases) for _ in range(replicas)]
                        for size in self.sizes]
        # the queue's own mix, measured: windows of its takes
        self.efficiencies: deque[float] = deque(maxlen=horizon_windows)
        self.open_window = [0] * len(self.mix)
        self.open_items = 0
        self.windows_since = 0  # closed windows since the last decision look
        self.t_period: float | None = None  # start of the current period
        self.gate_wait = 0.0  # drafter-seconds waiting at the gate in the period
        self.blocked = 0.0  # producer-seconds blocked at the cap in the period
        self.puts = [0] * len(self.mix)  # items put per bucket in the period
        self.put_bytes = self.put_items = 0  # for the mean item size (byte limits), whole run
        self.decisions = 0

    # ------------------------------------------------------------------ observations
    def observe_put(self, t: float, bucket: int, nbytes: int, blocked_s: float = 0.0) -> None:
        """An item entered the queue at ``t``; its producer was blocked at the cap for ``blocked_s``."""
        if self.t_period is None:
            self.t_period = t
        self.puts[bucket] += 1
        self.put_bytes += nbytes
        self.put_items += 1
        self.blocked += blocked_s
        for replicas in self.shadows:
            for shadow in replicas:
                shadow.arrive(bucket)

    def observe_take(self, t: float, bucket: int, n_items: int, wait_s: float) -> None:
        """A take of ``n_items`` from ``bucket`` at ``t`` by a drafter that waited ``wait_s`` at the gate."""
        if self.t_period is None:
            self.t_period = t
        self.gate_wait += wait_s
        self.open_window[bucket] += n_items
        self.open_items += n_items
        while self.open_items >= self.window:  # items of one take beyond the window start the next
            over = self.open_items - self.window
            self.open_window[bucket] -= over
            self.efficiencies.append(entropy(self.open_window) / self.expected_h)
            self.windows_since += 1
            self.open_window = [0] * len(self.mix)
            self.open_window[bucket] = over
            self.open_items = over

    # ------------------------------------------------------------------ the decision
    def interval(self) -> tuple[float, float, float]:
        """(mean, lower, upper) of the queue's own rolling mix_efficiency: mean +/- one standard error
        (as the run's metric states it). Reported with each decision; the decision itself reads the
        shadows, whose sizes differ (:meth:`size_needed`)."""
        mean, lower = _interval(self.efficiencies, 1.0)
        return mean, lower, 2 * mean - lower

    def size_needed(self, hi: int) -> tuple[int, list[tuple[int, float, float]]]:
        """The smallest size up to ``hi`` whose shadows' rolling lower end meets target + margin
        (interpolated between ladder sizes; no size beyond the smallest within ``PLATEAU`` of the best
        mix), and each size's (size, mean, lower end), over the horizon.

        The shadows track the queue's own measured mix: fed the arrivals of one simulated hour of the H200
        target-bound example (seeds 0, 1, 2), their mean at sizes 15, 20 and 25 is within 0.015 of what
        15/45, 20/60 and 25/75 measure on average over 16 starts of the metric's span (0.941 / 0.946 / 0.966
        against 0.940 / 0.958 / 0.968 at 15; 0.967 / 0.971 / 0.991 against 0.953 / 0.980 / 0.990 at 20);
        one tiling per shadow read 0.913 / 0.915 / 0.935 at 15.
        """
        table = []
        for size, replicas in zip(self.sizes, self.shadows, strict=True):
            if size > hi:
                break
            mean, lower = shadow_interval(replicas, self.z, self.phase_margin)
            table.append((size, mean, lower))
        goal = self.target + self.margin
        chosen: float | None = None
        for i, (k, _, lo) in enumerate(table):
            if lo >= goal:  # interpolated between this size and the one below, where the lower end crosses
                chosen = float(k)
                if i and table[i - 1][2] < goal:
                    k0, lo0 = table[i - 1][0], table[i - 1][2]
                    chosen = k0 + (k - k0) * (goal - lo0) / (lo - lo0)
                break
        if table:  # more than the smallest size within PLATEAU of the best mix buys little
            best = max(m for _, m, _ in table)
            shoulder = float(next(k for k, m, _ in table if m >= best - self.plateau))
            chosen = shoulder if chosen is None else min(chosen, shoulder)
        return (math.ceil(chosen) if chosen is not None else hi), table

    def decide(self, t: float, state: QueueState) -> Decision | None:
        """Between takes: a new config and its reason, or None (nothing to change, or too soon)."""
        if self.windows_since < self.period:
            return None
        ready = self.shadows[-1][0].windows >= min(self.horizon, self.first_windows)
        t0 = self.t_period if self.t_period is not None else t
        span = t - t0
        if span <= 0 or not ready:
            return None
        gate_frac = self.gate_wait / (self.n_drafter * span)
        blocked_frac = self.blocked / (self.n_target * span)
        rates = [n / span for n in self.puts]
        cfg = self.config
        target_bound = gate_frac > blocked_frac
        knob_name = "min_ready" if target_bound else "max_depth"
        knob = cfg.min_ready if target_bound else cfg.max_depth
        loss = blocked_frac if target_bound else gate_frac
        hi = self._knob_limit()
        raw, table = self.size_needed(hi)
        # smoothed in log space over decisions: near the mix's plateau the crossing moves a lot for a
        # small change of level (78 to 120 for +/-0.01 on a steady test input)
        prev = self.smoothed
        self.smoothed = math.log(raw) if prev is None else (1 - self.smooth) * prev + self.smooth * math.log(raw)
        needed = min(hi, max(self.floor_ready, round(math.exp(self.smoothed))))
        band = max(1, round(knob * self.dead_band))
        up = min(hi, max(knob + 1, math.ceil(knob * (1 + self.step_up))))
        down = max(self.floor_ready, min(knob - 1, math.floor(knob * (1 - self.step_down))))
        if not target_bound and loss > self.max_loss:
            new_knob, rule = up, f"raise: drafters wait {loss:.1%} at the gate > {self.max_loss:.0%}"
        elif needed > knob:
            new_knob = min(needed, up)
            rule = f"raise: size {needed} is the smallest that mixes >= {self.target + self.margin:.3f}"
        elif needed <= knob - band and (target_bound or loss <= self.max_loss):
            new_knob = max(needed, down)
            rule = f"lower: size {needed} mixes >= {self.target + self.margin:.3f}"
        else:
            new_knob, rule = knob, "hold"
        min_ready, max_depth = self._pair(target_bound, new_knob, blocked_frac)
        self._new_period(t)
        change = {k: v for k, v in (("min_ready", min_ready), ("max_depth", max_depth)) if v != getattr(cfg, k)}
        if not change:
            return None
        mean, lower, upper = self.interval()
        reason = {
            "mix_efficiency": mean, "interval": [lower, upper], "windows": len(self.efficiencies),
            "target": self.target, "bound": "target" if target_bound else "drafter", "knob": knob_name,
            "size_needed": needed, "size_needed_now": raw,
            "sizes": [[k, m, lo] for k, m, lo in table if k <= max(needed, knob) * 2],
            "arrival_items_per_s": rates, "drafter_gate_wait_frac": gate_frac, "producer_blocked_frac": blocked_frac,
            "depth": state.depth, "queued_bytes": state.queued_bytes, "rule": rule,
            "min_ready_binds": target_bound,
            "from": {"min_ready": cfg.min_ready, "max_depth": cfg.max_depth},
        }
        self.config = dataclasses.replace(cfg, min_ready=min_ready, max_depth=max_depth)
        self.decisions += 1
        return Decision(t, self.config, change, reason)

    def _knob_limit(self) -> int:
        """The largest value of the knob within auto_max_depth and the byte limits."""
        hi = self.limit_depth
        if self.byte_limit is not None and self.put_items:
            per_item = self.put_bytes / self.put_items
            hi = min(hi, max(1, int(self.byte_limit // max(per_item, 1.0))))
        return max(hi, self.floor_ready)

    def _pair(self, target_bound: bool, knob: int, blocked_frac: float) -> tuple[int, int]:
        """The (min_ready, max_depth) pair for the knob's new value."""
        cfg = self.config
        if target_bound:
            min_ready = knob
            max_depth = max(min_ready, min(self.limit_depth, math.ceil(min_ready * self.ratio)))
            if blocked_frac > self.max_loss:  # producers lose time at the cap: open the gap
                max_depth = max(max_depth, min(self.limit_depth, math.ceil(cfg.max_depth * (1 + self.step_up))))
            return min_ready, max_depth
        max_depth = max(1, knob)
        return min(cfg.min_ready, max_depth), max_depth

    def _new_period(self, t: float) -> None:
        self.windows_since = 0
        self.t_period = t
        self.gate_wait = self.blocked = 0.0
        self.puts = [0] * len(self.mix)

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        """What a resume keeps: the knobs it set, the measured windows, the smoothed size and the counts.
        The shadow buffers start empty again (they are rebuilt from the arrivals after the resume), so
        the first decision after a resume waits ``first_windows`` windows, as at the start."""
        return {"config": dataclasses.asdict(self.config), "efficiencies": list(self.efficiencies),
                "open_window": list(self.open_window), "open_items": self.open_items, "smoothed": self.smoothed,
                "put_bytes": self.put_bytes, "put_items": self.put_items, "decisions": self.decisions}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.config = QueueConfig(**state["config"])
        self.efficiencies = deque(state["efficiencies"], maxlen=self.horizon)
        self.open_window = list(state["open_window"])
        self.open_items = int(state["open_items"])
        self.smoothed = state["smoothed"]
        self.put_bytes, self.put_items = int(state["put_bytes"]), int(state["put_items"])
        self.decisions = int(state["decisions"])


def queue_memory_budget(memory_budget_gib: float | None) -> int | None:
    """Bytes of queued hidden states the autopilot may plan for: the sweep's per-device memory budget,
    when one is set (the queue lives on the target devices; their other memory is not subtracted).
    One home for the simulator and the coordinator."""
    return None if memory_budget_gib is None else int(memory_budget_gib * 2**30)
