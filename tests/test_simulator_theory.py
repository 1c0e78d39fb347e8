"""The SimPy simulator against queueing theory (in the style of Ciw's tests).

Every test builds the simplest workload (one bucket, every item identical) with exponential target
and drafter times, so docs/ARCHITECTURE.md's pipeline is a continuous-time Markov chain, and compares the
simulator's own metrics (``dflash.core.runmetrics.run_metrics`` over its records) with exact values:

1. M/M/1/K (docs/ARCHITECTURE.md "Theory mapping": min_ready 1, one item per take, one producer, one drafter,
   K = max_depth + 2), closed form from docs/REFERENCE.md.
2. The min-ready gate as Neuts' bulk-service (a, b) rule, M/M^(a,b)/1 with a cap that never binds.
3. Several drafters, several producers and a binding cap (threshold and hysteresis gates), against a
   finite CTMC built here from docs/ARCHITECTURE.md's queue semantics and solved with numpy.

How the tolerances are set (the same rule everywhere, see ``check``): each case is run with R
independent seeds (seeds of its own, so cases are independent evidence) after a warm-up, and the
mean over seeds of a metric must lie within Z standard errors of the exact value, the standard
error being the seed-to-seed standard deviation / sqrt(R). Each run's metric is an average over
thousands of items, so it is close to normal, and the studentised error of a correct simulator
follows Student's t with R - 1 = 15 degrees of freedom: P(|t_15| > 5) = 1.6e-4 per check, so the ~70
checks of the default run fail by chance with probability below 1.2% (a union bound; many checks are
strongly correlated). Every run is seeded, so the outcome is deterministic for a given simulator; a
change in how the simulator draws its random numbers re-rolls it. The bias of a finite run started
empty is O(relaxation time / span): the warm-up is many relaxation times and the span thousands of
seconds, far below the standard errors. ``test_mm1k_tolerance_separates_neighbouring_caps`` checks
that the tolerances are nevertheless sharp enough to tell K from K +- 1.
"""

from __future__ import annotations

import math
import zlib
from collections import deque
from dataclasses import dataclass

import numpy as np
import pytest

from dflash.core.config import (
    ClusterConfig,
    DflashConfig,
    MetricsConfig,
    QueueConfig,
    TimingConfig,
    WorkloadConfig,
)
from dflash.core.sampler import Sampler
from simulator.run import SimResult, simulate

R = 16  # independent seeds per case
Z = 5.0  # allowed error, in standard errors of the mean over seeds (two-sided t_15 tail 1.6e-4)

WORKLOAD = WorkloadConfig(max_len=100, bucket_bounds=(100,), seqs_per_item=1, order="random")
SAMPLER = Sampler([50] * 1000, WORKLOAD, seed=0)  # one bucket, every item identical


# ============================================================================ exact values
def mm1k(rho: float, k: int) -> np.ndarray:
    """Stationary distribution P_0..P_K of M/M/1/K (docs/REFERENCE.md), rho != 1."""
    n = np.arange(k + 1)
    return rho**n * (1 - rho) / (1 - rho ** (k + 1))


def mm1k_mean_in_system(rho: float, k: int) -> float:
    """docs/REFERENCE.md's closed form for L."""
    return rho * (1 - (k + 1) * rho**k + k * rho ** (k + 1)) / ((1 - rho) * (1 - rho ** (k + 1)))


@dataclass(frozen=True)
class BulkService:
    """M/M^(a,b)/1 (Neuts 1967) as docs/REFERENCE.md states it: P(idle), mean number waiting."""

    p_idle: float
    mean_waiting: float


def bulk_service(lam: float, mu: float, a: int, b: int) -> BulkService:
    if not lam < b * mu:
        raise ValueError("unstable: needs lambda < b mu")
    # r: the root in (0, 1) of mu z^(b+1) - (lambda + mu) z + lambda
    roots = np.roots([mu, *([0.0] * (b - 1)), -(lam + mu), lam])
    (r,) = [z.real for z in roots if abs(z.imag) < 1e-9 and 1e-12 < z.real < 1 - 1e-9]
    c = (1 - r) / (1 + (mu / lam) * (a - r * (1 - r**a) / (1 - r)))
    idle = [(mu / lam) * c * (1 - r ** (n + 1)) / (1 - r) for n in range(a)]  # idle, n < a waiting
    # busy with n waiting: C r^n, so sum_n n C r^n = C r / (1 - r)^2
    waiting = sum(n * p for n, p in enumerate(idle)) + c * r / (1 - r) ** 2
    assert abs(sum(idle) + c / (1 - r) - 1) < 1e-9  # the distribution is normalised
    return BulkService(sum(idle), waiting)


# ---------------------------------------------------------------------------- the CTMC oracle
@dataclass(frozen=True)
class Pipeline:
    """The knobs of one exponential pipeline (rates per worker)."""

    lam: float  # production rate of one producer
    mu: float  # service rate of one drafter (per take, whatever its size)
    n_producers: int = 1
    n_drafters: int = 1
    min_ready: int = 1
    max_depth: int = 10
    items_per_take: int = 1
    gate: str = "threshold"


State = tuple[int, int, int, bool]  # (queue depth, busy drafters, blocked producers, latch)


def _gate_open(p: Pipeline, q: int, blocked: int, latched: bool) -> bool:
    """docs/ARCHITECTURE.md's gate (no drain: producers never close)."""
    if q == 0:
        return False
    if blocked:
        return True  # a producer blocked at the cap opens it
    return latched if p.gate == "hysteresis" else q >= p.min_ready


def _put(p: Pipeline, q: int, latched: bool) -> tuple[int, bool]:
    q += 1
    return q, latched or q >= p.min_ready  # the hysteresis latch closes at min_ready on a put


def _settle(p: Pipeline, q: int, busy: int, blocked: int, latched: bool) -> State:
    """Everything that happens at one instant after a completion (puts have already been made).

    Idle drafters take one at a time, each re-checking the gate; a take removes
    min(q, items_per_take) items (a depth of 0 reopens the hysteresis latch), and right after each
    take the producers blocked at the cap are admitted while the depth is below max_depth, before
    the next idle drafter looks at the gate.
    """
    while busy < p.n_drafters and _gate_open(p, q, blocked, latched):
        q -= min(q, p.items_per_take)
        busy += 1
        if q == 0:
            latched = False
        while blocked and q < p.max_depth:
            q, latched = _put(p, q, latched)
            blocked -= 1
    return q, busy, blocked, latched


def _transitions(p: Pipeline, s: State) -> list[tuple[float, State]]:
    q, busy, blocked, latched = s
    out = []
    producing = p.n_producers - blocked
    if producing:  # one producer finishes its item: it enters, or the producer blocks at the cap
        if q < p.max_depth:
            q2, l2 = _put(p, q, latched)
            out.append((producing * p.lam, _settle(p, q2, busy, blocked, l2)))
        else:
            out.append((producing * p.lam, _settle(p, q, busy, blocked + 1, latched)))
    if busy:  # one drafter finishes its step and asks for the next take
        out.append((busy * p.mu, _settle(p, q, busy - 1, blocked, latched)))
    return out


@dataclass(frozen=True)
class ChainValues:
    items_per_s: float
    drafter_utilization: float
    producer_blocked_frac: float
    mean_queue_depth: float
    n_states: int


def solve_chain(p: Pipeline) -> ChainValues:
    """Build the reachable chain from the empty start, solve pi Q = 0, return the metrics."""
    start: State = (0, 0, 0, False)
    index = {start: 0}
    todo = deque([start])
    edges: list[tuple[int, int, float]] = []
    while todo:
        s = todo.popleft()
        for rate, t in _transitions(p, s):
            if t not in index:
                index[t] = len(index)
                todo.append(t)
            edges.append((index[s], index[t], rate))
    n = len(index)
    gen = np.zeros((n, n))
    for i, j, rate in edges:
        if i != j:
            gen[i, j] += rate
            gen[i, i] -= rate
    a = gen.T.copy()
    a[-1, :] = 1.0  # replace one balance equation by the normalisation
    rhs = np.zeros(n)
    rhs[-1] = 1.0
    pi = np.linalg.solve(a, rhs)
    assert pi.min() > -1e-12 and np.allclose(pi @ gen, 0.0, atol=1e-10)
    states = np.array([(q, busy, blocked) for q, busy, blocked, _ in index], dtype=float)
    q, busy, blocked = (states[:, i] for i in range(3))
    return ChainValues(
        # every finished item enters the queue eventually: items/s = lambda * E[producing]
        items_per_s=p.lam * float(pi @ (p.n_producers - blocked)),
        drafter_utilization=float(pi @ busy) / p.n_drafters,
        producer_blocked_frac=float(pi @ blocked) / p.n_producers,
        mean_queue_depth=float(pi @ q),
        n_states=n,
    )


# ============================================================================ running the simulator
def config(p: Pipeline, seed: int, warmup_s: float) -> DflashConfig:
    timing = TimingConfig(target_fixed_s=1 / p.lam, target_per_token_s=0.0, target_noise="exponential",
                          drafter_fixed_s=1 / p.mu, drafter_per_anchor_s=0.0, drafter_noise="exponential")
    return DflashConfig(
        workload=WORKLOAD,
        cluster=ClusterConfig(n_target=p.n_producers, n_drafter=p.n_drafters, drafter_sync="none"),
        queue=QueueConfig(min_ready=p.min_ready, max_depth=p.max_depth, items_per_take=p.items_per_take,
                          gate=p.gate),
        timing=timing, metrics=MetricsConfig(window=32, warmup_s=warmup_s), seed=seed)


def run_seeds(p: Pipeline, *, sim_seconds: float, warmup_s: float) -> list[SimResult]:
    """R runs with seeds of their own (a hash of the case), so that cases are independent evidence
    rather than common random numbers (with shared seeds their errors all lean the same way)."""
    seed0 = zlib.crc32(repr((p, sim_seconds)).encode()) % 10**8
    results = []
    for seed in range(seed0, seed0 + R):
        res = simulate(config(p, seed, warmup_s), SAMPLER, sim_seconds=sim_seconds, keep_records=True)
        assert res.metrics["steady_state_reached"]
        assert res.metrics["steady_state_start_s"] == pytest.approx(warmup_s)
        results.append(res)
    return results


def metric(results: list[SimResult], name: str) -> np.ndarray:
    return np.array([r.metrics[name] for r in results], dtype=float)


def tolerance(samples: np.ndarray) -> float:
    return Z * float(np.std(samples, ddof=1)) / math.sqrt(len(samples))


def check(name: str, samples: np.ndarray, exact: float) -> None:
    """The mean over seeds is within Z standard errors (seed-to-seed spread / sqrt(R)) of ``exact``."""
    mean, tol = float(np.mean(samples)), tolerance(samples)
    assert tol > 0, name
    assert abs(mean - exact) <= tol, (
        f"{name}: simulated {mean:.5f} +- {tol / Z:.5f} (s.e.), exact {exact:.5f}, "
        f"off by {abs(mean - exact) / (tol / Z):.1f} s.e.")


def sojourns(res: SimResult, t0: float, t1: float) -> np.ndarray:
    """Per item produced in [t0, t1]: time from the end of its production (it then waits, held by
    a blocked producer or queued) to the end of the drafter step that trains it."""
    done = {i: r["t"] + r["compute_s"] for r in res.take for i in r["item_ids"]}
    return np.array([done[r["item_id"]] - r["t_end"] for r in res.produce if t0 <= r["t_end"] <= t1])


def queue_waits(res: SimResult, t0: float, t1: float) -> np.ndarray:
    """Per item put in [t0, t1]: time from its put (after any block) to the take that removes it."""
    taken = {i: r["t"] for r in res.take for i in r["item_ids"]}
    out = []
    for r in res.produce:
        put_t = r["t_end"] + r["blocked_s"]
        if t0 <= put_t <= t1:
            out.append(taken[r["item_id"]] - put_t)
    return np.array(out)


# ============================================================================ the exact values first
def test_closed_forms_reproduce_reference_checks() -> None:
    p = mm1k(0.9, 10)
    assert p.sum() == pytest.approx(1.0)
    assert p[-1] == pytest.approx(0.0508, abs=5e-5)
    assert mm1k_mean_in_system(0.9, 10) == pytest.approx(3.969, abs=5e-4)
    assert mm1k_mean_in_system(0.9, 10) == pytest.approx(float(np.arange(11) @ p))
    bs = bulk_service(3.0, 1.0, 2, 5)
    assert bs.p_idle == pytest.approx(0.13534, abs=5e-6)
    assert bs.mean_waiting == pytest.approx(4.44186, abs=5e-6)


@pytest.mark.parametrize(("rho", "k"), [(0.9, 10), (1.3, 6), (0.5, 3)])
def test_chain_oracle_is_mm1k_for_one_producer_one_drafter(rho: float, k: int) -> None:
    """The CTMC built from docs/ARCHITECTURE.md's rules reproduces the theory mapping K = max_depth + 2."""
    v = solve_chain(Pipeline(lam=rho, mu=1.0, max_depth=k - 2))
    p = mm1k(rho, k)
    assert v.n_states == k + 1
    assert v.producer_blocked_frac == pytest.approx(p[-1], rel=1e-9)
    assert v.items_per_s == pytest.approx(rho * (1 - p[-1]), rel=1e-9)
    assert v.drafter_utilization == pytest.approx(1 - p[0], rel=1e-9)
    # in state n: one item in service if n >= 1, one held by the blocked producer if n = K
    assert v.mean_queue_depth == pytest.approx(mm1k_mean_in_system(rho, k) - (1 - p[0]) - p[-1], rel=1e-9)


@pytest.mark.parametrize(("lam", "mu", "a", "b"), [(3.0, 1.0, 2, 5), (2.0, 1.0, 3, 4)])
def test_chain_oracle_is_neuts_bulk_service_when_the_cap_never_binds(lam, mu, a, b) -> None:
    bs = bulk_service(lam, mu, a, b)
    v = solve_chain(Pipeline(lam=lam, mu=mu, min_ready=a, max_depth=150, items_per_take=b))
    assert v.producer_blocked_frac < 1e-9
    assert 1 - v.drafter_utilization == pytest.approx(bs.p_idle, abs=1e-8)
    assert v.mean_queue_depth == pytest.approx(bs.mean_waiting, abs=1e-6)


# ============================================================================ 1. M/M/1/K
# Run lengths: the default run simulates 5k-17k items per seed; the slow variant five times as many
# (standard errors shrink by sqrt(5)).
LENGTHS = [pytest.param(1, id="x1"), pytest.param(5, id="x5", marks=pytest.mark.slow)]
# (rho = lambda / mu, K, simulated seconds per seed); mu = 1. Near rho = 1 the chain relaxes slowly
# (L's seed-to-seed spread is largest), so that case runs longer.
MM1K_CASES = [(0.9, 10, 20_000.0), (1.3, 6, 6_000.0), (0.5, 3, 6_000.0)]
MM1K_WARMUP = 200.0  # the relaxation time is a few tens of seconds at most
_mm1k_cache: dict[tuple[float, int, int], list[SimResult]] = {}


def mm1k_runs(rho: float, k: int, seconds: float) -> list[SimResult]:
    key = (rho, k, seconds)
    if key not in _mm1k_cache:
        _mm1k_cache[key] = run_seeds(Pipeline(lam=rho, mu=1.0, max_depth=k - 2),
                                     sim_seconds=seconds, warmup_s=MM1K_WARMUP)
    return _mm1k_cache[key]


@pytest.mark.parametrize("scale", LENGTHS)
@pytest.mark.parametrize(("rho", "k", "seconds"), MM1K_CASES)
def test_mm1k(rho: float, k: int, seconds: float, scale: int) -> None:
    """One producer (rate lambda), one drafter (rate mu), min_ready 1, one item per take.

    The chain's state n = items in the system: queued + one in service if n >= 1 + one held by the
    blocked producer if n = K. With blocking after service the producer is blocked exactly in state
    K, so producer_blocked_frac estimates P_K; drafter_utilization estimates 1 - P_0 (and the gate
    wait is the rest); mean_queue_depth + drafter_utilization + producer_blocked_frac, all time
    averages over the same span, estimates L; items_per_s estimates lambda (1 - P_K).
    """
    runs = mm1k_runs(rho, k, scale * seconds)
    p = mm1k(rho, k)
    lam, big_l = rho, mm1k_mean_in_system(rho, k)
    util, blocked = metric(runs, "drafter_utilization"), metric(runs, "producer_blocked_frac")
    depth = metric(runs, "mean_queue_depth")
    check("items_per_s", metric(runs, "items_per_s"), lam * (1 - p[-1]))
    check("producer_blocked_frac", blocked, p[-1])
    check("drafter_utilization", util, 1 - p[0])
    check("drafter_gate_wait_frac", metric(runs, "drafter_gate_wait_frac"), p[0])
    check("target_utilization", metric(runs, "target_utilization"), 1 - p[-1])
    check("mean_queue_depth", depth, big_l - (1 - p[0]) - p[-1])
    check("L", depth + util + blocked, big_l)
    # Little's law W = L / throughput, from the records: an item is in the system from the end of
    # its production to the end of the drafter step that trains it.
    end = scale * seconds
    w = np.array([sojourns(r, MM1K_WARMUP, end - 100.0).mean() for r in runs])
    check("sojourn W", w, big_l / (lam * (1 - p[-1])))
    for r in runs:  # the cap, read off the take records
        assert max(t["depth_before"] for t in r.take) <= k - 2


@pytest.mark.parametrize("scale", LENGTHS)
def test_mm1k_tolerance_separates_neighbouring_caps(scale: int) -> None:
    """The check on L is sharp: K - 1 or K + 1 (an off-by-one in the cap) would have failed it.

    (P_K alone is not that sharp in the default run: at rho = 0.9, P_10 = 0.0508 and P_11 = 0.0437
    differ by little more than its tolerance, 5 s.e. ~ 0.005.)
    """
    for rho, k, seconds in MM1K_CASES:
        runs = mm1k_runs(rho, k, scale * seconds)
        big_l = sum(metric(runs, m) for m in ("mean_queue_depth", "drafter_utilization",
                                               "producer_blocked_frac"))
        for wrong in (k - 1, k + 1):
            assert abs(big_l.mean() - mm1k_mean_in_system(rho, wrong)) > tolerance(big_l), (rho, k, wrong)


# ============================================================================ 2. bulk service
@pytest.mark.parametrize("scale", LENGTHS)
@pytest.mark.parametrize(("lam", "mu", "a", "b", "seconds"), [(3.0, 1.0, 2, 5, 2_200.0),
                                                               (2.0, 1.0, 3, 4, 3_000.0)])
def test_min_ready_gate_is_neuts_bulk_service(lam: float, mu: float, a: int, b: int, seconds: float,
                                              scale: int) -> None:
    """M/M^(a,b)/1: min_ready = a, items_per_take = b, a cap that never binds.

    The drafter's time per take is exponential whatever the take's size (fixed cost only). It
    starts a step only when at least a items wait and takes at most b: Neuts' rule. The server is
    idle exactly while the drafter waits at the gate: 1 - drafter_utilization (compute time only)
    estimates P(idle); mean_queue_depth (items waiting, not those in the drafter's step) estimates
    the mean number waiting, and by Little's law an item waits mean_waiting / lambda in the queue.
    """
    bs = bulk_service(lam, mu, a, b)
    warmup, seconds = 100.0, scale * seconds
    runs = run_seeds(Pipeline(lam=lam, mu=mu, min_ready=a, max_depth=10_000, items_per_take=b),
                     sim_seconds=seconds, warmup_s=warmup)
    check("P(idle) = 1 - drafter_utilization", 1 - metric(runs, "drafter_utilization"), bs.p_idle)
    check("drafter_gate_wait_frac", metric(runs, "drafter_gate_wait_frac"), bs.p_idle)
    check("mean_queue_depth", metric(runs, "mean_queue_depth"), bs.mean_waiting)
    check("items_per_s", metric(runs, "items_per_s"), lam)
    assert all(r.metrics["producer_blocked_frac"] == 0.0 for r in runs)
    wq = np.array([queue_waits(r, warmup, seconds - 100.0).mean() for r in runs])
    check("queue wait Wq", wq, bs.mean_waiting / lam)
    # Neuts' rule, read off the take records: a take needs a waiting items and removes min(b, waiting).
    for r in runs:
        assert all(t["depth_before"] >= a and len(t["item_ids"]) == min(b, t["depth_before"])
                   for t in r.take)


# ============================================================================ 3. the CTMC oracle
CHAIN_CASES = [
    # two independent drafters, one producer, a binding cap
    pytest.param(Pipeline(lam=1.8, mu=1.0, n_drafters=2, min_ready=1, max_depth=4), id="2d-m1-D4"),
    pytest.param(Pipeline(lam=2.4, mu=1.0, n_drafters=2, min_ready=3, max_depth=5), id="2d-m3-D5-over"),
    pytest.param(Pipeline(lam=1.6, mu=1.0, n_drafters=2, min_ready=3, max_depth=6), id="2d-m3-D6"),
    # hysteresis: several idle drafters take at one instant while the latch stays open
    pytest.param(Pipeline(lam=1.8, mu=1.0, n_drafters=2, min_ready=3, max_depth=5, gate="hysteresis"),
                 id="2d-m3-D5-hyst"),
    pytest.param(Pipeline(lam=2.5, mu=1.0, n_drafters=3, min_ready=4, max_depth=6, gate="hysteresis"),
                 id="3d-m4-D6-hyst"),
    # two producers, two items per take: one take re-admits both producers blocked at the cap
    pytest.param(Pipeline(lam=1.5, mu=1.0, n_producers=2, n_drafters=2, min_ready=3, max_depth=5,
                          items_per_take=2), id="2p-2d-b2-m3-D5"),
]
CHAIN_SECONDS, CHAIN_WARMUP = 2_500.0, 100.0


@pytest.mark.parametrize("scale", LENGTHS)
@pytest.mark.parametrize("p", CHAIN_CASES)
def test_pipeline_against_ctmc(p: Pipeline, scale: int) -> None:
    """Independent drafters (drafter_sync "none") and a binding cap against the exact chain."""
    exact = solve_chain(p)
    runs = run_seeds(p, sim_seconds=scale * CHAIN_SECONDS, warmup_s=CHAIN_WARMUP)
    check("items_per_s", metric(runs, "items_per_s"), exact.items_per_s)
    check("drafter_utilization", metric(runs, "drafter_utilization"), exact.drafter_utilization)
    check("drafter_gate_wait_frac", metric(runs, "drafter_gate_wait_frac"), 1 - exact.drafter_utilization)
    check("producer_blocked_frac", metric(runs, "producer_blocked_frac"), exact.producer_blocked_frac)
    check("target_utilization", metric(runs, "target_utilization"), 1 - exact.producer_blocked_frac)
    check("mean_queue_depth", metric(runs, "mean_queue_depth"), exact.mean_queue_depth)


# ============================================================================ exact identities
# Identities the records must satisfy exactly (found as defects, now fixed: same-instant order of
# an admitted producer's put, and work still open at the close).
def test_max_queue_depth_never_exceeds_the_cap() -> None:
    p = Pipeline(lam=1.3, mu=1.0, max_depth=4)  # the producer blocks at the cap often
    res = simulate(config(p, 0, 10.0), SAMPLER, sim_seconds=200.0, keep_records=True)
    assert max(t["depth_before"] for t in res.take) == p.max_depth  # the queue itself is right
    assert res.metrics["max_queue_depth"] <= p.max_depth


def test_drafter_time_fractions_tile_the_span() -> None:
    """One independent drafter is always either computing or waiting at the gate."""
    p = Pipeline(lam=0.2, mu=5.0, max_depth=4)  # the drafter is almost always waiting
    res = simulate(config(p, 0, 0.0), SAMPLER, sim_seconds=200.0, keep_records=True)
    m = res.metrics
    assert m["drafter_utilization"] + m["drafter_gate_wait_frac"] == pytest.approx(1.0, abs=1e-9)


def test_producer_time_fractions_tile_the_span() -> None:
    """One producer is always either computing or blocked at the cap."""
    p = Pipeline(lam=0.2, mu=5.0, max_depth=4)  # the producer is almost always computing
    res = simulate(config(p, 0, 0.0), SAMPLER, sim_seconds=200.0, keep_records=True)
    m = res.metrics
    assert m["target_utilization"] + m["producer_blocked_frac"] == pytest.approx(1.0, abs=1e-9)
