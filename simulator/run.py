"""One simulated run: producers and drafters as SimPy processes around the shared queue core.

Producers draw items from the trainer's sampler, "compute" them for the target time model, and
put them (blocking after service at the cap). Drafters take through the policy and "train" for the
drafter time model plus the move of the item's hidden states from its producer (per byte, within a
node or across nodes); synchronised drafters wait for the slowest at the end of every step, then
for the DDP all-reduce of the drafter's gradient.

Metrics are streamed (:class:`simulator.stream.StreamMetrics`): memory does not grow with simulated
time. Asked for (``keep_records``, ``records_dir``, or a loss model that replays the take order),
the run also keeps DESIGN.md's records, in memory and on disk, whose metrics
:func:`dflash.core.runmetrics.run_metrics` (the trainer's function) computes the same.
"""

from __future__ import annotations

import random
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import simpy

from dflash.core.config import DflashConfig
from dflash.core.memory_model import allreduce_seconds, bytes_per_token, fullest_device_bytes
from dflash.core.queue_core import QueueCore, QueueItem
from dflash.core.records import SCHEMA_VERSION, RecordWriter
from dflash.core.runmetrics import RunTrace
from dflash.core.sampler import Sampler
from simulator.engine import QueueGet, SimHSQueue, TakeRequest, item_stream
from simulator.stream import StreamMetrics
from simulator.timing import DrafterTime, TargetTime, anchors_for


@dataclass
class SimResult:
    metrics: dict[str, Any]
    summary: dict[str, Any]
    trace: RunTrace = field(repr=False)
    item_mix: list[float] = field(default_factory=list)
    bucket_bounds: tuple[int, ...] = ()
    wall_s: float = 0.0
    series: dict[str, list[Any]] = field(default_factory=dict, repr=False)  # downsampled, for plots
    records_kept: bool = True

    @property
    def produce(self) -> list[dict[str, Any]]:
        self._need_records()
        return list(self.trace.produce_records())

    @property
    def take(self) -> list[dict[str, Any]]:
        self._need_records()
        return list(self.trace.take_records())

    def _need_records(self) -> None:
        if not self.records_kept:
            raise ValueError("this run kept no records: simulate(..., keep_records=True) keeps them")

    def as_json(self) -> dict[str, Any]:
        return {"metrics": self.metrics, "summary": self.summary, "item_mix": self.item_mix,
                "bucket_bounds": list(self.bucket_bounds), "wall_s": self.wall_s}


def simulate(cfg: DflashConfig, sampler: Sampler, *, sim_seconds: float, max_items: int | None = None,
             max_steps: int | None = None, records_dir: str | Path | None = None, run_id: str | None = None,
             keep_records: bool = False, progress: Callable[[float], None] | None = None) -> SimResult:
    """Run the pipeline for ``sim_seconds`` simulated seconds (or until ``max_items`` are drained, or
    ``max_steps`` drafter steps are done: the trainer's ``--max-steps`` stop, for like-for-like budgets).

    ``keep_records`` keeps every produce and take record (``records_dir`` writes them too);
    ``progress`` is called with the simulated time every 1/200 of ``sim_seconds``."""
    wall0 = time.perf_counter()
    env = simpy.Environment()
    q = cfg.queue
    n_target, n_drafter = cfg.cluster.n_target, cfg.cluster.n_drafter
    sync = cfg.cluster.drafter_sync == "step"
    mix = sampler.item_mix()
    core = QueueCore(q, sampler.n_buckets, mix=mix, seed=cfg.seed)
    seed_rng = random.Random(cfg.seed + 7919)
    target_time = TargetTime(cfg.timing, random.Random(seed_rng.random()))
    drafter_time = DrafterTime(cfg.timing, random.Random(seed_rng.random()))
    bpt = bytes_per_token(cfg)
    seq_anchors = _sequence_anchors(cfg, sampler)
    move_s = _transfer_s_per_byte(cfg)  # [producer][drafter]
    moves = any(x for row in move_s for x in row)
    allreduce_s = allreduce_seconds(cfg, n_drafter) if sync else 0.0

    records = keep_records or records_dir is not None or cfg.loss_model.fitted
    trace = RunTrace()
    produce_rows, take_rows = trace.produce_rows, trace.take_rows  # field orders: dflash.core.runmetrics
    stream = StreamMetrics(p=mix, min_ready=q.min_ready, window=cfg.metrics.window, warmup_s=cfg.metrics.warmup_s,
                           n_target=n_target, n_drafter=n_drafter, n_buckets=sampler.n_buckets)
    stream_take = stream.take
    held: dict[int, list[QueueItem]] = {}  # drafter -> items in its current step
    blocked: dict[int, QueueItem] = {}  # producer -> item held at the cap
    held_since: dict[int, float] = {}  # producer -> when it finished the item it holds
    producing: dict[int, float] = {}  # producer -> when it started the item it computes
    resident = [0] * n_target  # hidden-state bytes each producer holds (queued or at the cap)
    peaks = [0, 0]  # the most bytes one producer held, the most one take held

    def on_take(ev: QueueGet | TakeRequest, items: list[QueueItem], reason: str, depth_before: int,
                bucket_depths: tuple[int, ...]) -> None:
        now = env._now  # type: ignore[attr-defined]
        tokens = n_seqs = anchors = nbytes = 0
        move = 0.0
        for it in items:
            w, an, _, _ = it.payload
            tokens += it.real_tokens
            n_seqs += it.n_seqs
            anchors += an
            nbytes += it.nbytes
            resident[w] -= it.nbytes
            if moves:
                move += it.nbytes * move_s[w][ev.index]
        if nbytes > peaks[1]:
            peaks[1] = nbytes
        compute = ev.compute_s = drafter_time(tokens, anchors) + move
        wait = now - ev.t_request
        stream_take(now, ev.index, items, items[0].bucket, wait, compute, tokens, n_seqs, nbytes, depth_before,
                    bucket_depths)
        if records:
            take_rows.append((now, ev.index, ev.step, [it.item_id for it in items], items[0].bucket, wait,
                              depth_before, bucket_depths, reason, compute, tokens, n_seqs, anchors))

    queue = SimHSQueue(env, core, on_take, stream.put)
    try_put, try_take, compute = queue.try_put, queue.try_take, queue.compute
    specs = sampler.iter_items() if max_items is None else item_stream(sampler.iter_items(), max_items)
    producers_left = [n_target]

    def producer(w: int) -> Any:
        for spec in specs:
            t0 = producing[w] = env._now  # type: ignore[attr-defined]
            yield compute(target_time(spec.n_seqs, spec.padded_len, t0))
            del producing[w]
            t1 = env._now  # type: ignore[attr-defined]
            nbytes = spec.n_seqs * spec.padded_len * bpt
            item = QueueItem(spec.item_id, spec.bucket, spec.n_seqs, spec.real_tokens, spec.padded_len, nbytes,
                             (w, sum(map(seq_anchors.__getitem__, spec.seq_indices)), t0, t1))
            resident[w] += nbytes
            if resident[w] > peaks[0]:
                peaks[0] = resident[w]
            if try_put(item):
                blocked_s = 0.0
            else:
                blocked[w], held_since[w] = item, t1
                blocked_s = yield queue.put(item, w)
                del blocked[w], held_since[w]
            if records:
                produce_rows.append((t1, spec.item_id, w, spec.bucket, spec.n_seqs, spec.real_tokens,
                                     spec.padded_len, t0, t1, blocked_s, nbytes))
        producers_left[0] -= 1
        if producers_left[0] == 0:
            queue.close()

    step_no = [0]
    trained = [0]
    budget_done = env.event()

    def budget_spent() -> bool:
        """True (and the run stops) once ``max_steps`` steps are done."""
        if max_steps is not None and step_no[0] >= max_steps:
            if not budget_done.triggered:
                budget_done.succeed()
            return True
        return False
    waiting: dict[int, float] = {}  # drafter -> since when it waits for its take

    def synchronised_drafters() -> Any:
        """drafter_sync = "step": every drafter takes (in index order, each re-checking the gate)
        and computes from the moment it gets its items; the step ends with the slowest, then the
        gradient all-reduce. One process for all drafters: the same decisions as one process each
        behind a barrier, with a fraction of the events."""
        drafters = range(n_drafter)
        while True:
            step, t_step = step_no[0], env._now  # type: ignore[attr-defined]
            finish = t_step
            for d in drafters:
                waiting[d] = t_step
            for d in drafters:
                got = try_take(d, step, t_step)
                request, items = got if got is not None else (yield from queue.take_items(d, step, t_step))
                del waiting[d]
                if items is not None:
                    held[d] = items
                    end = env._now + request.compute_s  # type: ignore[attr-defined]
                    if end > finish:
                        finish = end
            if not held:
                return  # producers closed and the queue is drained
            yield compute(finish + allreduce_s - env._now)  # type: ignore[attr-defined]
            n = 0
            for items in held.values():
                n += len(items)
            held.clear()
            trained[0] += n
            step_no[0] += 1
            if max_steps is not None and budget_spent():
                return

    def independent_drafter(d: int) -> Any:
        while True:
            waiting[d] = env.now
            request, items = yield from queue.take_items(d, step_no[0])
            del waiting[d]
            if items is None:
                return
            step_no[0] += 1
            held[d] = items
            yield queue.compute(request.compute_s)
            trained[0] += len(held.pop(d))
            if budget_spent():
                return

    for w in range(n_target):
        env.process(producer(w))
    if sync:
        env.process(synchronised_drafters())
    else:
        for d in range(n_drafter):
            env.process(independent_drafter(d))
    _run(env, sim_seconds, budget_done if max_steps is not None else None, progress)
    close_t = min(env.now, sim_seconds)

    # Stop: queued items and items held at the cap are discarded; steps in progress complete.
    in_steps = sum(len(v) for v in held.values())
    queued_at_stop = core.depth
    stranded = {"queued": queued_at_stop, "blocked_producers": len(blocked),
                "gate_open_at_stop": core.gate() is not None}
    summary = {
        "produced": sum(core.counters.produced) + len(blocked), "trained": trained[0] + in_steps,
        "discarded_at_stop": queued_at_stop + len(blocked), "replayed": 0,
        "takes": core.counters.takes, "steps": step_no[0], "stranded": stranded,
        "drained": core.closed and queued_at_stop == 0,
    }
    open_intervals = {  # work in progress at the close, which no record shows yet
        "target_busy": [(t0, close_t) for t0 in producing.values()],
        "target_blocked": [(t1, close_t) for t1 in held_since.values()],
        "drafter_wait": [(t, close_t) for t in waiting.values()],
    }
    summary["open_intervals"] = open_intervals  # in the summary record, so records alone give the metrics
    metrics = stream.finish(close_t, core, open_intervals)
    core.discard_all()
    metrics.update(predicted_roughness(cfg, trace))
    metrics.update(peak_producer_bytes=peaks[0], peak_drafter_bytes=peaks[1],
                   peak_device_bytes=fullest_device_bytes(cfg, n_target=n_target, producer_bytes=peaks[0],
                                                          drafter_bytes=peaks[1]))
    series = {"depth": stream.depth_series.points, "windows": stream.window_series.points}
    result = SimResult(metrics, summary, trace, mix, sampler.bounds, time.perf_counter() - wall0, series, records)
    if records_dir is not None:
        write_records(result, records_dir, run_id or f"sim-{uuid.uuid4().hex[:8]}", close_t)
    return result


def _run(env: simpy.Environment, sim_seconds: float, budget_done: Any, progress: Callable[[float], None] | None
         ) -> None:
    """Run to ``sim_seconds`` (or the step budget), telling ``progress`` of the simulated time."""
    if budget_done is not None:
        env.run(until=env.any_of([budget_done, env.timeout(sim_seconds)]))
        return
    if progress is None:
        env.run(until=sim_seconds)
        return
    chunks = 200
    for k in range(1, chunks + 1):
        env.run(until=sim_seconds * k / chunks)
        progress(env.now)


_ANCHORS: weakref.WeakKeyDictionary[Sampler, dict[tuple[Any, ...], list[int]]] = weakref.WeakKeyDictionary()


def _sequence_anchors(cfg: DflashConfig, sampler: Sampler) -> list[int]:
    """Each sequence's anchor count, computed once per sampler and drafter shape (a sweep runs many
    simulations over one sampler; computing them costs ~3 us per item of a one-hour run)."""
    key = (cfg.drafter.anchors, cfg.drafter.block_size, cfg.timing.response_fraction)
    per_sampler = _ANCHORS.setdefault(sampler, {})
    if key not in per_sampler:
        prompts = sampler.prompt_lengths
        per_sampler[key] = [anchors_for([n], cfg.timing, cfg.drafter, None if prompts is None else [prompts[k]])
                            for k, n in enumerate(sampler.lengths)]
    return per_sampler[key]


def _transfer_s_per_byte(cfg: DflashConfig) -> list[list[float]]:
    """Seconds per byte from producer ``w`` to drafter ``d``: ranks fill nodes in order, targets
    first (each target worker on ``gpus_per_target`` GPUs); a move within a node costs the intra
    rate, across nodes the inter rate."""
    c, t = cfg.cluster, cfg.timing
    node = c.gpus_per_node
    return [[t.transfer_intra_s_per_byte if (w * c.gpus_per_target) // node ==
             (c.n_target * c.gpus_per_target + d) // node else t.transfer_inter_s_per_byte
             for d in range(c.n_drafter)] for w in range(c.n_target)]


def predicted_roughness(cfg: DflashConfig, trace: RunTrace) -> dict[str, Any]:
    """``loss_roughness`` of this take order under the calibrated loss model (None without one)."""
    if not cfg.loss_model.fitted:
        return {"loss_roughness": None}
    from simulator.loss_model import makeup_from_takes, predict_loss_roughness

    return predict_loss_roughness(makeup_from_takes(list(trace.take_records())), cfg.loss_model, seed=cfg.seed)


def write_records(result: SimResult, out_dir: str | Path, run_id: str, close_t: float) -> None:
    """The run's records in the shared schema (``source = "sim"``)."""
    with RecordWriter(out_dir, run_id, "sim") as w:
        for r in sorted(result.trace.produce_records(), key=lambda r: r["t"]):
            w.write("produce", **r)
        for r in result.trace.take_records():
            w.write("take", **r)
        w.write("summary", t=close_t, **result.summary, schema=SCHEMA_VERSION)
