"""One simulated run: producers and drafters as SimPy processes around the shared queue core.

Producers draw items from the trainer's sampler, "compute" them for the target time model, and
put them (blocking after service at the cap). Drafters take through the policy and "train" for the
drafter time model plus the move of the item's hidden states from its producer (per byte, within a
node or across nodes); synchronised drafters wait for the slowest at the end of every step, then
for the DDP all-reduce of the drafter's gradient.

Metrics are streamed (:class:`simulator.stream.StreamMetrics`): memory does not grow with simulated
time. Asked for (``keep_records``, ``records_dir``, or a loss model that replays the take order),
the run also keeps docs/ARCHITECTURE.md's records, in memory and on disk, whose metrics
:func:`dflash.core.runmetrics.run_metrics` (the trainer's function) computes the same.
"""

from __future__ import annotations

import random
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import simpy

from dflash.core.autopilot import Autopilot, AutopilotConfig, QueueState
from dflash.core.config import DflashConfig
from dflash.core.memory_model import allreduce_seconds, bytes_per_token, fullest_device_bytes
from dflash.core.queue_core import QueueCore, QueueItem
from dflash.core.records import SCHEMA_VERSION, RecordWriter
from dflash.core.runmetrics import RunTrace
from dflash.core.sampler import ItemSpec, Sampler
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
    controls: list[dict[str, Any]] = field(default_factory=list, repr=False)  # the autopilot's control records

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
                "bucket_bounds": list(self.bucket_bounds), "wall_s": self.wall_s,
                **({"controls": self.controls} if self.controls else {})}


def simulate(cfg: DflashConfig, sampler: Sampler, *, sim_seconds: float, max_items: int | None = None,
             max_steps: int | None = None, records_dir: str | Path | None = None, run_id: str | None = None,
             keep_records: bool = False, progress: Callable[[float], None] | None = None,
             items: Iterator[ItemSpec] | None = None, target_cost: Callable[[float], float] | None = None
             ) -> SimResult:
    """Run the pipeline for ``sim_seconds`` simulated seconds (or until ``max_items`` are drained, or
    ``max_steps`` drafter steps are done: the trainer's ``--max-steps`` stop, for like-for-like budgets).

    ``keep_records`` keeps every produce and take record (``records_dir`` writes them too);
    ``progress`` is called with the simulated time every 1/200 of ``sim_seconds``.

    Mid-run changes (benchmarks/autopilot.py): ``items`` replaces the sampler's item stream (e.g. one
    whose length-grouped runs grow partway); ``target_cost(t)`` scales a target item started at ``t``
    (e.g. per-item costs drifting 30%)."""
    wall0 = time.perf_counter()
    records = keep_records or records_dir is not None or cfg.loss_model.fitted
    run = _Pipeline(cfg, sampler, max_items=max_items, max_steps=max_steps, records=records, items=items,
                    target_cost=target_cost)
    _run(run.env, sim_seconds, run.budget_done if max_steps is not None else None, progress)
    close_t = min(run.env.now, sim_seconds)
    result = run.result(close_t)
    result.wall_s = time.perf_counter() - wall0
    if records_dir is not None:
        write_records(result, records_dir, run_id or f"sim-{uuid.uuid4().hex[:8]}", close_t)
    return result


class _Pipeline:
    """One run's processes and state: producers, drafters (synchronised or not), the queue, the
    streamed metrics and, when asked, the records. The hot loops bind what they use to locals."""

    def __init__(self, cfg: DflashConfig, sampler: Sampler, *, max_items: int | None, max_steps: int | None,
                 records: bool, items: Iterator[ItemSpec] | None = None,
                 target_cost: Callable[[float], float] | None = None) -> None:
        self.cfg, self.sampler, self.max_steps, self.records = cfg, sampler, max_steps, records
        self.env = env = simpy.Environment()
        self.n_target, self.n_drafter = cfg.cluster.n_target, cfg.cluster.n_drafter
        self.mix = sampler.item_mix()
        self.core = QueueCore(cfg.queue, sampler.n_buckets, mix=self.mix, seed=cfg.seed)
        seed_rng = random.Random(cfg.seed + 7919)
        self.target_time: Callable[[int, int, float], float] = TargetTime(cfg.timing, random.Random(seed_rng.random()))
        if target_cost is not None:
            base_time = self.target_time
            self.target_time = lambda n_seqs, padded_len, t0: base_time(n_seqs, padded_len, t0) * target_cost(t0)
        self.drafter_time = DrafterTime(cfg.timing, random.Random(seed_rng.random()))
        self.trace = RunTrace()  # field orders: dflash.core.runmetrics
        self.stream = StreamMetrics(p=self.mix, min_ready=cfg.queue.min_ready, window=cfg.metrics.window,
                                    warmup_s=cfg.metrics.warmup_s, n_target=self.n_target, n_drafter=self.n_drafter,
                                    n_buckets=sampler.n_buckets)
        self.held: dict[int, list[QueueItem]] = {}  # drafter -> items in its current step
        self.blocked: dict[int, QueueItem] = {}  # producer -> item held at the cap
        self.held_since: dict[int, float] = {}  # producer -> when it finished the item it holds
        self.producing: dict[int, float] = {}  # producer -> when it started the item it computes
        self.waiting: dict[int, float] = {}  # drafter -> since when it waits for its take
        self.resident = [0] * self.n_target  # hidden-state bytes each producer holds (queued or at the cap)
        self.peaks = [0, 0]  # the most bytes one producer held, the most one take held
        self.step_no, self.trained, self.producers_left = [0], [0], [self.n_target]
        self.budget_done = env.event()
        # [queue] mode = "auto": the autopilot (the coordinator's own code) sees every put and take and
        # may change min_ready/max_depth between takes; its decisions are kept as control records
        self.autopilot = Autopilot(AutopilotConfig.for_run(cfg, self.mix, self.n_target, self.n_drafter)) \
            if cfg.queue.mode == "auto" else None
        self.controls: list[dict[str, Any]] = []
        self.knobs: list[tuple[float, int, int]] = [(0.0, cfg.queue.min_ready, cfg.queue.max_depth)]
        self.queue = SimHSQueue(env, self.core, self._on_take_callback(), self._on_put_callback())
        stream = sampler.iter_items() if items is None else items
        self.specs = stream if max_items is None else item_stream(stream, max_items)
        for w in range(self.n_target):
            env.process(self.producer(w))
        if cfg.cluster.drafter_sync == "step":
            env.process(self.synchronised_drafters(allreduce_seconds(cfg, self.n_drafter)))
        else:
            for d in range(self.n_drafter):
                env.process(self.independent_drafter(d))

    def _on_take_callback(self) -> Callable[..., None]:
        """The queue's take hook: the take's work, its compute time (drafter model + hidden-state
        moves from each item's producer), streamed metrics and the record. A closure: it runs per take."""
        env, resident, peaks, drafter_time = self.env, self.resident, self.peaks, self.drafter_time
        move_s = _transfer_s_per_byte(self.cfg)  # [producer][drafter]
        moves = any(x for row in move_s for x in row)
        stream_take, take_rows, records = self.stream.take, self.trace.take_rows, self.records
        autopilot, core, controls, knobs = self.autopilot, self.core, self.controls, self.knobs

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
            if autopilot is not None:
                autopilot.observe_take(now, items[0].bucket, len(items), wait)
                decision = autopilot.decide(now, QueueState(core.depth, core.queued_bytes, len(core.blocked)))
                if decision is not None:
                    core.reconfigure(decision.config)
                    self.stream.min_ready = decision.config.min_ready  # the span is judged by the knob in force
                    controls.append(decision.record())
                    knobs.append((now, decision.config.min_ready, decision.config.max_depth))

        return on_take

    def _on_put_callback(self) -> Callable[[float, QueueItem], None]:
        """The queue's put hook: streamed metrics, and the autopilot's arrivals and cap blocks."""
        stream_put, autopilot = self.stream.put, self.autopilot
        if autopilot is None:
            return stream_put
        observe = autopilot.observe_put

        def on_put(t: float, item: QueueItem) -> None:
            stream_put(t, item)
            observe(t, item.bucket, item.nbytes, t - item.payload[3])  # blocked since its compute ended

        return on_put

    def producer(self, w: int) -> Any:
        """Draw the next item of the shared stream, compute it, put it (blocking at the cap)."""
        env, queue, resident, peaks = self.env, self.queue, self.resident, self.peaks
        producing, blocked, held_since = self.producing, self.blocked, self.held_since
        try_put, compute, target_time = queue.try_put, queue.compute, self.target_time
        bpt, seq_anchors = bytes_per_token(self.cfg), _sequence_anchors(self.cfg, self.sampler)
        produce_rows, records = self.trace.produce_rows, self.records
        for spec in self.specs:
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
        self.producers_left[0] -= 1
        if self.producers_left[0] == 0:
            queue.close()

    def budget_spent(self) -> bool:
        """True (and the run stops) once ``max_steps`` steps are done."""
        if self.max_steps is not None and self.step_no[0] >= self.max_steps:
            if not self.budget_done.triggered:
                self.budget_done.succeed()
            return True
        return False

    def synchronised_drafters(self, allreduce_s: float) -> Any:
        """drafter_sync = "step": every drafter takes (in index order, each re-checking the gate)
        and computes from the moment it gets its items; the step ends with the slowest, then the
        gradient all-reduce. One process for all drafters: the same decisions as one process each
        behind a barrier, with a fraction of the events."""
        env, queue, held, waiting = self.env, self.queue, self.held, self.waiting
        try_take, compute, step_no, trained = queue.try_take, queue.compute, self.step_no, self.trained
        drafters = range(self.n_drafter)
        limited = self.max_steps is not None
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
            if limited and self.budget_spent():
                return

    def independent_drafter(self, d: int) -> Any:
        """drafter_sync = "none": take, train, repeat, on its own clock."""
        env, queue, held, waiting = self.env, self.queue, self.held, self.waiting
        while True:
            waiting[d] = env.now
            request, items = yield from queue.take_items(d, self.step_no[0])
            del waiting[d]
            if items is None:
                return
            self.step_no[0] += 1
            held[d] = items
            yield queue.compute(request.compute_s)
            self.trained[0] += len(held.pop(d))
            if self.budget_spent():
                return

    def result(self, close_t: float) -> SimResult:
        """Stop at ``close_t``: queued items and items held at the cap are discarded (counted); steps
        in progress complete. The summary, the metrics and the downsampled series."""
        core, blocked, stream = self.core, self.blocked, self.stream
        queued_at_stop = core.depth
        summary: dict[str, Any] = {
            "produced": sum(core.counters.produced) + len(blocked),
            "trained": self.trained[0] + sum(len(v) for v in self.held.values()),
            "discarded_at_stop": queued_at_stop + len(blocked), "replayed": 0,
            "skipped_no_anchors": 0,  # the sampler drops anchor-less sequences before they are items
            "takes": core.counters.takes, "steps": self.step_no[0],
            "stranded": {"queued": queued_at_stop, "blocked_producers": len(blocked),
                         "gate_open_at_stop": core.gate() is not None},
            "drained": core.closed and queued_at_stop == 0,
        }
        open_intervals = {  # work in progress at the close, which no record shows yet
            "target_busy": [(t0, close_t) for t0 in self.producing.values()],
            "target_blocked": [(t1, close_t) for t1 in self.held_since.values()],
            "drafter_wait": [(t, close_t) for t in self.waiting.values()],
        }
        summary["open_intervals"] = open_intervals  # in the summary record, so records alone give the metrics
        metrics = stream.finish(close_t, core, open_intervals)
        core.discard_all()
        metrics.update(predicted_roughness(self.cfg, self.trace))
        producer_peak, take_peak = self.peaks
        metrics.update(peak_producer_bytes=producer_peak, peak_drafter_bytes=take_peak,
                       peak_device_bytes=fullest_device_bytes(self.cfg, n_target=self.n_target,
                                                              producer_bytes=producer_peak, drafter_bytes=take_peak))
        series = {"depth": stream.depth_series.points, "windows": stream.window_series.points}
        if self.autopilot is not None:
            series["knobs"] = [*self.knobs, (close_t, *self.knobs[-1][1:])]
            metrics.update(autopilot_decisions=len(self.controls), final_min_ready=core.config.min_ready,
                           final_max_depth=core.config.max_depth)
        return SimResult(metrics, summary, self.trace, self.mix, self.sampler.bounds, 0.0, series, self.records,
                         self.controls)


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
        for r in result.controls:
            w.write("control", **r)
        w.write("summary", t=close_t, **result.summary, schema=SCHEMA_VERSION)
