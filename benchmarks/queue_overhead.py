"""Microseconds per put+take: our thread-safe HS queue versus a plain queue.Queue, same payloads.

Run: python benchmarks/queue_overhead.py [--items N] [--repeats R]
Two shapes, each measured side by side in this one run and printed as ratios:
  single-thread  put then take in one thread (pure per-operation overhead, no contention);
  two-thread     one producer thread and one consumer thread (what the trainer does).
The payload is a real CPU tensor of one item's hidden states (SmolLM2: 5 layers x 576 x 256 tokens,
bf16). Goal from issue #2: <= 2x queue.Queue with take logging on.
"""

from __future__ import annotations

import argparse
import queue
import threading
import time

import torch

from dflash.core.config import QueueConfig
from dflash.core.queue_core import QueueItem
from dflash.pipeline.hsqueue import HSQueue

N_BUCKETS = 5


def make_items(n: int) -> list[QueueItem]:
    payload = torch.zeros(256, 5 * 576, dtype=torch.bfloat16)
    return [QueueItem(f"0:{i % N_BUCKETS}:{i}", i % N_BUCKETS, n_seqs=1, real_tokens=256, padded_len=256,
                      nbytes=payload.numel() * 2, payload=payload) for i in range(n)]


def plain_single(items: list[QueueItem]) -> float:
    q: queue.Queue[QueueItem] = queue.Queue(maxsize=len(items) + 1)
    t0 = time.perf_counter()
    for it in items:
        q.put(it)
        q.get()
    return time.perf_counter() - t0


def ours_single(items: list[QueueItem], log: bool) -> float:
    q = HSQueue(QueueConfig(min_ready=1, max_depth=len(items) + 1), N_BUCKETS, log_takes=log)
    t0 = time.perf_counter()
    for it in items:
        q.put(it)
        q.take()
    return time.perf_counter() - t0


def plain_threads(items: list[QueueItem], depth: int) -> float:
    q: queue.Queue[QueueItem | None] = queue.Queue(maxsize=depth)

    def consume() -> None:
        while q.get() is not None:
            pass

    c = threading.Thread(target=consume)
    t0 = time.perf_counter()
    c.start()
    for it in items:
        q.put(it)
    q.put(None)
    c.join()
    return time.perf_counter() - t0


def ours_threads(items: list[QueueItem], depth: int, log: bool) -> float:
    q = HSQueue(QueueConfig(min_ready=1, max_depth=depth), N_BUCKETS, log_takes=log)

    def consume() -> None:
        while (got := q.take()) is not None:
            q.task_done(got)

    c = threading.Thread(target=consume)
    t0 = time.perf_counter()
    c.start()
    for it in items:
        q.put(it)
    q.close()
    c.join()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--depth", type=int, default=90, help="max depth for the two-thread shape")
    args = ap.parse_args()
    items = make_items(args.items)
    print(f"torch {torch.__version__}, {args.items} items x {args.repeats} repeats, "
          f"payload {items[0].nbytes / 1e6:.2f} MB (shared tensor, not copied)")

    shapes = {
        "single-thread": {
            "queue.Queue": lambda: plain_single(items),
            "HSQueue (no log)": lambda: ours_single(items, log=False),
            "HSQueue (take log)": lambda: ours_single(items, log=True),
        },
        "two-thread": {
            "queue.Queue": lambda: plain_threads(items, args.depth),
            "HSQueue (no log)": lambda: ours_threads(items, args.depth, log=False),
            "HSQueue (take log)": lambda: ours_threads(items, args.depth, log=True),
        },
    }
    for shape, runs in shapes.items():
        # interleave the contenders across repeats so drift hits all of them alike
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.repeats):
            for name, fn in runs.items():
                times[name].append(fn())
        base = min(times["queue.Queue"])  # best of R: the least-disturbed run of each
        print(f"\n{shape}:")
        print(f"  {'contender':<20} {'us/put+take':>12} {'ratio':>7}")
        for name, ts in times.items():
            med = min(ts)
            print(f"  {name:<20} {1e6 * med / args.items:>12.2f} {med / base:>7.2f}x")


if __name__ == "__main__":
    main()
