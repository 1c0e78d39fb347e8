"""Microseconds per put+take: the coordinator's decisions versus a plain queue.Queue, same payloads.

Run: python benchmarks/queue_overhead.py [--items N] [--repeats R]
The rank job's queue is :class:`dflash.pipeline.coordinator.Coordinator` (the one ``QueueCore``, run
by the coordinator thread; no lock of its own, no tensors: the payload is the producer's metadata).
Two shapes, each measured side by side in this one run and printed as ratios:
  put-take     ready then request + serve, one item at a time (pure per-decision overhead);
  steady       a queue held at depth ``--depth`` (min-ready = depth), every take re-checking the gate.
The plain ``queue.Queue`` carries a real CPU tensor of one item's hidden states (SmolLM2: 5 layers
x 576 x 256 tokens, bf16), as an in-process queue would. Goal from issue #2: <= 2x queue.Queue.
"""

from __future__ import annotations

import argparse
import queue
import time

import torch

from dflash.core.config import QueueConfig
from dflash.core.queue_core import QueueItem
from dflash.pipeline.coordinator import Assignment, Coordinator

N_BUCKETS = 5


def make_items(n: int, payload: object) -> list[QueueItem]:
    nbytes = 256 * 5 * 576 * 2
    return [QueueItem(f"0:{i % N_BUCKETS}:{i}", i % N_BUCKETS, n_seqs=1, real_tokens=256, padded_len=256,
                      nbytes=nbytes, payload=payload) for i in range(n)]


def plain_put_take(items: list[QueueItem]) -> float:
    q: queue.Queue[QueueItem] = queue.Queue(maxsize=len(items) + 1)
    t0 = time.perf_counter()
    for it in items:
        q.put(it)
        q.get()
    return time.perf_counter() - t0


def coordinator_put_take(items: list[QueueItem], depth: int) -> float:
    """Ready reports keep ``depth`` items queued; each request is served one take (gate checked)."""
    c = Coordinator(QueueConfig(min_ready=depth, max_depth=depth + 1), N_BUCKETS, n_producers=1, n_drafters=1)
    taken = 0
    t0 = time.perf_counter()
    for k, it in enumerate(items):
        c.ready(0, it, float(k))
        if k + 1 < depth:
            continue
        c.request(0, k, float(k))
        taken += sum(isinstance(a, Assignment) for a in c.serve(float(k)))
    assert taken == len(items) - depth + 1, taken
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--depth", type=int, default=90, help="queue depth held in the steady shape")
    args = ap.parse_args()
    tensor = torch.zeros(256, 5 * 576, dtype=torch.bfloat16)
    items = make_items(args.items, tensor)
    meta = make_items(args.items, {"tensors": [[256, 2880]], "dtype": "bfloat16"})
    print(f"torch {torch.__version__}, {args.items} items x {args.repeats} repeats, payload "
          f"{tensor.numel() * 2 / 1e6:.2f} MB in queue.Queue (shared tensor), metadata in the coordinator")
    runs = {"queue.Queue": lambda: plain_put_take(items),
            "Coordinator put-take": lambda: coordinator_put_take(meta, 1),
            f"Coordinator steady (depth {args.depth})": lambda: coordinator_put_take(meta, args.depth)}
    # interleave the contenders across repeats so drift hits all of them alike
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            times[name].append(fn())
    base = min(times["queue.Queue"])  # best of R: the least-disturbed run of each
    print(f"  {'contender':<32} {'us/put+take':>12} {'ratio':>7}")
    for name, ts in times.items():
        best = min(ts)
        print(f"  {name:<32} {1e6 * best / args.items:>12.2f} {best / base:>7.2f}x")


if __name__ == "__main__":
    main()
