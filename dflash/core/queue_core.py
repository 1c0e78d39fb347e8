"""The hidden-state queue's decisions, with no threads and no clock.

:class:`QueueCore` holds the bucket contents and answers the questions of docs/ARCHITECTURE.md's queue
semantics: may this producer put (the cap), may a drafter take and why (the gate), and which items
a take removes (the policy, oldest first inside a bucket). It never blocks and never reads a clock;
callers pass the time in. The trainer's coordinator (:mod:`dflash.pipeline.coordinator`, run by one
thread of the rank job) wraps it for many ranks; the SimPy engine wraps it in SimPy events. Both
therefore make the very same decisions from the same sequence of calls.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dflash.core.config import QueueConfig
from dflash.core.policies import NO_HEAD, SelectionPolicy, make_policy

# Why a take was allowed: the gate's reasons, recorded on every take record.
GATE_READY = "ready"  # depth >= min_ready (or the hysteresis latch is open)
GATE_CAP = "cap"  # a producer is blocked at a cap
GATE_DRAIN = "drain"  # producers have closed


@dataclass(eq=False, slots=True)
class QueueItem:
    """One target micro-batch. ``payload`` holds tensors in the trainer and is None in the simulator."""

    item_id: str
    bucket: int
    n_seqs: int = 1
    real_tokens: int = 0
    padded_len: int = 0
    nbytes: int = 0
    payload: Any = None


# A queued entry is a plain tuple (global put sequence number, put time, item): it is created and
# read on every put and take, and a tuple is several times cheaper than any object.
Entry = tuple[int, float, QueueItem]


@dataclass
class Counters:
    produced: list[int]
    taken: list[int]
    takes: int = 0
    trained: int = 0
    discarded_at_stop: int = 0
    max_depth_seen: int = 0
    peak_queued_bytes: int = 0
    per_bucket_max_age_s: list[float] = field(default_factory=list)


class QueueCore:
    """Bucket contents + gate + cap + policy. Not thread-safe: callers serialise access."""

    def __init__(self, config: QueueConfig, n_buckets: int, *, mix: Sequence[float] | None = None,
                 seed: int = 0) -> None:
        if n_buckets < 1:
            raise ValueError("n_buckets must be >= 1")
        self.n_buckets = n_buckets
        self.mix = list(mix) if mix is not None else None
        self.rng = random.Random(seed)
        self.buckets: list[deque[Entry]] = [deque() for _ in range(n_buckets)]
        self.counts = [0] * n_buckets
        self.depth = 0
        self.queued_bytes = 0
        self.blocked: dict[int, int] = {}  # producer index -> bytes of the item it holds at the cap
        self.closed = False
        self.latched = False  # hysteresis: gate open since depth reached min_ready
        self._seq = 0
        self.counters = Counters(produced=[0] * n_buckets, taken=[0] * n_buckets,
                                 per_bucket_max_age_s=[0.0] * n_buckets)
        self.config = config
        self.policy: SelectionPolicy = make_policy(config.policy, n_buckets, self.mix)

    # ---------------------------------------------------------------- configuration
    def reconfigure(self, config: QueueConfig) -> None:
        """Swap the knobs between takes (live re-tuning); the queued items stay where they are."""
        if config.policy != self.config.policy:
            self.policy = make_policy(config.policy, self.n_buckets, self.mix)
        self.config = config
        if self.depth >= config.min_ready:
            self.latched = True

    # ---------------------------------------------------------------- producer side
    def fits(self, item: QueueItem) -> bool:
        """The cap: depth below max_depth and, if set, the bytes within max_bytes.

        An item always fits an empty queue, so a byte cap smaller than one item cannot deadlock.
        """
        return self._fits_bytes(item.nbytes)

    def admissible(self, producer: int, item: QueueItem) -> bool:
        """May this producer put now? Its item fits and no lower-index blocked producer's does.

        This is docs/ARCHITECTURE.md's "among producers by worker index": when a take frees room, blocked
        producers enter in index order. The threaded queue and the SimPy engine both obey it.
        """
        return self.fits(item) and not any(
            other < producer and self._fits_bytes(nbytes) for other, nbytes in self.blocked.items())

    def _fits_bytes(self, nbytes: int) -> bool:
        if self.depth >= self.config.max_depth:
            return False
        mb = self.config.max_bytes
        return mb is None or self.depth == 0 or self.queued_bytes + nbytes <= mb

    def block(self, producer: int, nbytes: int) -> None:
        self.blocked[producer] = nbytes

    def unblock(self, producer: int) -> None:
        self.blocked.pop(producer, None)

    def try_put(self, item: QueueItem, t: float) -> bool:
        """``fits`` then ``put`` in one call (the uncontended hot path of the threaded queue)."""
        if self.fits(item):
            self.put(item, t)
            return True
        return False

    def put(self, item: QueueItem, t: float) -> None:
        if self.closed:
            raise RuntimeError("put after close(): producers have closed the queue")
        if not 0 <= item.bucket < self.n_buckets:
            raise ValueError(f"item bucket {item.bucket} outside 0..{self.n_buckets - 1}")
        b = item.bucket
        self.buckets[b].append((self._seq, t, item))
        self._seq += 1
        self.counts[b] += 1
        depth = self.depth = self.depth + 1
        qbytes = self.queued_bytes = self.queued_bytes + item.nbytes
        c = self.counters
        c.produced[b] += 1
        if depth > c.max_depth_seen:
            c.max_depth_seen = depth
        if qbytes > c.peak_queued_bytes:
            c.peak_queued_bytes = qbytes
        if depth >= self.config.min_ready:
            self.latched = True

    def close(self) -> None:
        """Producers are done: the gate opens for draining until the queue is empty."""
        self.closed = True

    # ---------------------------------------------------------------- drafter side
    def gate(self) -> str | None:
        """The reason a take may happen now, or None while the gate is shut (or nothing is queued)."""
        if self.depth == 0:
            return None
        if self.closed:
            return GATE_DRAIN
        if self.blocked:
            return GATE_CAP
        if self.config.gate == "hysteresis":
            return GATE_READY if self.latched else None
        return GATE_READY if self.depth >= self.config.min_ready else None

    def take(self, t: float) -> tuple[int, list[QueueItem]]:
        """Remove min(count, items_per_take) oldest items of the bucket the policy picks."""
        if self.depth == 0:
            raise RuntimeError("take from an empty queue")
        policy = self.policy
        heads = ([q[0][0] if q else NO_HEAD for q in self.buckets] if policy.needs_heads else ())
        b = policy.choose(self.counts, heads, self.depth, self.rng)
        q = self.buckets[b]
        if not q:
            raise AssertionError(f"policy {policy.name} chose empty bucket {b}")
        n = min(len(q), self.config.items_per_take)
        entries = [q.popleft()] if n == 1 else [q.popleft() for _ in range(n)]
        self.counts[b] -= n
        self.depth -= n
        c = self.counters
        c.taken[b] += n
        c.takes += 1
        ages = c.per_bucket_max_age_s
        items = []
        for _, t_put, item in entries:
            items.append(item)
            self.queued_bytes -= item.nbytes
            if t - t_put > ages[b]:
                ages[b] = t - t_put
        if self.depth == 0:
            self.latched = False
        if policy.stateful:
            policy.on_take(b, n)
        return b, items

    # ---------------------------------------------------------------- stopping and state
    def discard_all(self) -> list[QueueItem]:
        """Stop: everything still queued is discarded (counted), not trained."""
        items = [e[2] for q in self.buckets for e in q]
        for q in self.buckets:
            q.clear()
        self.counts = [0] * self.n_buckets
        self.depth = 0
        self.queued_bytes = 0
        self.counters.discarded_at_stop += len(items)
        return items

    def queued_ids(self) -> list[str]:
        """Ids of queued items in put order (for checkpoints: they must be produced again on resume)."""
        entries = sorted((e for q in self.buckets for e in q), key=lambda e: e[0])
        return [e[2].item_id for e in entries]

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs besides the items themselves: the RNG and the policy state."""
        return {"rng": self.rng.getstate(), "policy": self.policy.state_dict(), "latched": self.latched}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rng_state = state["rng"]
        self.rng.setstate((rng_state[0], tuple(rng_state[1]), rng_state[2]))
        self.policy.load_state_dict(state["policy"])
        self.latched = bool(state["latched"])
