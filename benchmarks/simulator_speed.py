"""How fast the simulator runs, beside raw SimPy on a plain M/M/1 model, in one run.

Run: python benchmarks/simulator_speed.py [--sim-seconds S] [--repeats R]
Prints, for examples/h200-8b-drafter-bound.toml: simulated seconds per wall second and items per
wall second; SimPy's raw speed on an M/M/1 queue (customers per wall second, Resource-based, the
textbook model); and the ratio of our per-item cost to SimPy's per-customer cost.
Goals: per-item cost <= 2x raw SimPy's per-customer cost (issue #18; it was 3.21x); >= 10,000
simulated seconds per wall second for the example on one core. CPU time of this process is
measured (time.process_time), best of R, so other load on the machine disturbs it less.

Side by side (issue #29 item 3): the engine reads SimPy's private clock ``env._now`` on its per-item
paths. The same run with every ``_now`` read going through a property, which is exactly what the
public ``env.now`` costs (SimPy's ``now`` is ``return self._now`` behind a property), shows what
reading the public API everywhere would cost; it also counts the reads per item. Where the reads are
once per blocked put, waiting take or step, the engine uses ``env.now``.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import simpy

import simulator.run as sim_run
from dflash.core.config import load_config
from simulator.run import simulate
from simulator.workload import make_sampler

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "h200-8b-drafter-bound.toml"


def raw_simpy_mm1(customers: int, lam: float = 0.9, mu: float = 1.0, seed: int = 0) -> float:
    """CPU seconds for an M/M/1 queue (Resource with capacity 1) to serve ``customers``."""
    rng = random.Random(seed)
    env = simpy.Environment()
    server = simpy.Resource(env, capacity=1)
    done = [0]

    def customer():
        with server.request() as req:
            yield req
            yield env.timeout(rng.expovariate(mu))
        done[0] += 1

    def source():
        for _ in range(customers):
            yield env.timeout(rng.expovariate(lam))
            env.process(customer())

    env.process(source())
    t0 = time.process_time()
    env.run()
    assert done[0] == customers
    return time.process_time() - t0


class PublicClockEnvironment(simpy.Environment):
    """SimPy's environment with ``_now`` behind a property: every read the engine makes costs what
    the public ``env.now`` (a property over ``_now``) costs. SimPy's own reads pay it too, so the
    difference is an upper bound on switching the engine's reads alone."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.__dict__["_clock"] = 0.0
        super().__init__(*args, **kwargs)

    @property
    def _now(self) -> float:  # type: ignore[override]
        return self._clock

    @_now.setter
    def _now(self, value: float) -> None:
        self._clock = value


class CountingClockEnvironment(PublicClockEnvironment):
    """As :class:`PublicClockEnvironment`, counting the reads (SimPy's own included)."""

    reads = 0

    @property
    def _now(self) -> float:  # type: ignore[override]
        CountingClockEnvironment.reads += 1
        return self._clock

    @_now.setter
    def _now(self, value: float) -> None:
        self._clock = value


def run_with_environment(env_class: type, cfg, sampler, sim_seconds: float) -> tuple[float, int]:
    """CPU seconds of one simulation whose SimPy environment is ``env_class``, and its items."""
    original = sim_run.simpy.Environment
    sim_run.simpy.Environment = env_class
    try:
        t0 = time.process_time()
        res = simulate(cfg, sampler, sim_seconds=sim_seconds)
        return time.process_time() - t0, res.summary["produced"]
    finally:
        sim_run.simpy.Environment = original


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sim-seconds", type=float, default=3600.0)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cfg = load_config(EXAMPLE)
    sampler = make_sampler(cfg.workload, cfg.target.model, cfg.seed, cfg.drafter.block_size)
    simulate(cfg, sampler, sim_seconds=60.0)  # warm the sampler's epoch cache, as a sweep would

    ours, items = [], 0
    for _ in range(args.repeats):
        t0 = time.process_time()
        res = simulate(cfg, sampler, sim_seconds=args.sim_seconds)
        ours.append(time.process_time() - t0)
        items = res.summary["produced"]
    ours_s = min(ours)
    raw_s = min(raw_simpy_mm1(items) for _ in range(args.repeats))
    per_item = ours_s / items
    per_customer = raw_s / items
    print(f"example {EXAMPLE.name}: {args.sim_seconds:g} simulated s, {items} items, best of {args.repeats}")
    print(f"  ours      {ours_s:.3f} s CPU  {args.sim_seconds / ours_s:>10,.0f} sim-s per wall-s  "
          f"{items / ours_s:>9,.0f} items/s  {1e6 * per_item:6.1f} us/item")
    print(f"  raw SimPy {raw_s:.3f} s CPU  (M/M/1, {items} customers)  {items / raw_s:>9,.0f} customers/s  "
          f"{1e6 * per_customer:6.1f} us/customer")
    print(f"  ratio ours per item / SimPy per customer: {per_item / per_customer:.2f}x")
    public = [run_with_environment(PublicClockEnvironment, cfg, sampler, args.sim_seconds)[0]
              for _ in range(args.repeats)]
    CountingClockEnvironment.reads = 0
    run_with_environment(CountingClockEnvironment, cfg, sampler, args.sim_seconds)
    reads_per_item = CountingClockEnvironment.reads / items
    public_s = min(public)
    print(f"  clock through a property (the cost of env.now everywhere): {public_s:.3f} s CPU, "
          f"{1e6 * public_s / items:6.1f} us/item, {public_s / ours_s - 1:+.1%} vs env._now; "
          f"{reads_per_item:.1f} clock reads per item (SimPy's own included)")


if __name__ == "__main__":
    main()
