"""The real pipeline: target worker threads -> the bucketed hidden-state queue -> drafter steps.

Target workers (one thread per target device) draw items from the shared sampler, tokenise the
item's conversations with the chat template, run the frozen target up to its deepest captured
layer and put the captured states into :class:`dflash.pipeline.hsqueue.HSQueue`. The drafter side runs in
the calling thread: each step every drafter worker takes through the queue policy (in index
order, each take re-checking the gate), computes its forward and backward, and the step sums the
workers' weighted gradient sums and divides by the global sum of the slot weights (upstream's
normalisation), so the update equals one worker on the combined batch; a step whose takes hold no
anchor is no step (counted ``skipped_no_anchors``). On one device the drafter workers are data-parallel ranks run one
after another on one model (same arithmetic as DDP with a summed all-reduce).

Everything is written as DESIGN.md's records (``source = "real"``) under the output directory,
and the run's metrics come from :func:`dflash.core.runmetrics.run_metrics`, the simulator's function.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.core.config import DflashConfig
from dflash.core.precision import autocast_on, state_dtype_name
from dflash.core.queue_core import QueueItem
from dflash.core.records import RecordWriter, clean_json, export_parquet, read_records
from dflash.core.run_config import write_run_config
from dflash.core.runmetrics import RunTrace, loss_roughness, run_metrics
from dflash.core.sampler import ItemSpec, sampler_for
from dflash.pipeline.checkpoint import (
    ControlWatch,
    ItemFeed,
    latest_verified,
    load_state,
    rejected_change,
    write_checkpoint,
)
from dflash.pipeline.hsqueue import HSQueue
from dflash.pipeline.telemetry import NvmlSampler, RollingMix, StageTimer, WandbLogger, gpu_metrics, queue_health

QUEUE_WAIT_S = 600.0  # a put or take waiting this long is a bug (deadlock), not a slow target


@dataclass
class TrainResult:
    out_dir: Path
    summary: dict[str, Any]
    metrics: dict[str, Any]
    losses: list[float]


class TrainingData:
    """Conversations, their lengths and the sampler over them; encodes sequences on demand."""

    def __init__(self, cfg: DflashConfig, tokenizer: Any, conversations: list[Any] | None = None) -> None:
        from dflash.data.conversations import load_conversations, resolve_dataset

        w = cfg.workload
        if conversations is None:
            path = resolve_dataset(w.dataset, cfg.target.model)
            conversations, _ = load_conversations(path, w.sample, w.max_conversations)
        self.conversations = conversations
        self.tokenizer = tokenizer
        self.max_len = w.max_len
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()
        lengths, prompts = self._encoded_lengths() if len(conversations) <= 2000 else self._cached_lengths(cfg)
        # Sequences without an eligible anchor are dropped by the sampler (trained nothing, cost a forward).
        self.sampler = sampler_for(cfg, lengths, prompts)

    def _encoded_lengths(self) -> tuple[list[int], list[int]]:
        """Lengths (truncated) and tokens before the first response token, from the encodings themselves."""
        lengths, prompts = [], []
        for i in range(len(self.conversations)):
            ids, mask = self.encode(i)
            hits = torch.nonzero(mask, as_tuple=False)
            lengths.append(int(ids.numel()))
            prompts.append(int(hits[0]) if hits.numel() else int(ids.numel()))
        return lengths, prompts

    def _cached_lengths(self, cfg: DflashConfig) -> tuple[list[int], list[int] | None]:
        """Untruncated lengths and prompt lengths from the length cache (the same tokenisation, no re-encoding)."""
        from dflash.data.lengths import cached_lengths

        table = cached_lengths(cfg.workload, model=cfg.target.model)
        ids = [c.id for c in self.conversations]
        if list(table.ids) != ids:
            raise RuntimeError("the length cache does not match the data set's conversations")
        return list(table.lengths), list(table.prompt_lengths) or None

    def encode(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        from dflash.model.target import encode_conversation

        with self._lock:
            hit = self._cache.get(index)
        if hit is None:
            hit = encode_conversation(self.tokenizer, self.conversations[index], self.max_len)
            with self._lock:
                self._cache[index] = hit
        return hit


class Trainer:
    """One training run. ``target`` (a LoadedTarget) and ``conversations`` may be injected (tests)."""

    def __init__(self, cfg: DflashConfig, out_dir: str | Path, *, target: Any = None,
                 conversations: list[Any] | None = None, progress: Callable[[str], None] | None = print,
                 run_id: str | None = None, resume: bool = False, wandb_mode: str = "disabled") -> None:
        from dflash.model.drafter import DFlashDrafter, DrafterSpec, default_mask_token_id
        from dflash.model.target import HiddenStateCapture, capture_layer_ids, load_target
        from dflash.pipeline.optim import LrSchedule, build_optimizer

        self.cfg = cfg
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.progress = progress or (lambda _msg: None)
        self.run_id = run_id or f"real-{uuid.uuid4().hex[:8]}"
        tdev, ddev = cfg.target.devices, cfg.drafter.devices
        if all(d == "cpu" for d in (*tdev, *ddev)):
            roles = len(tdev) + 1
            torch.set_num_threads(cfg.train.cpu_threads or max(1, (os.cpu_count() or 2) // roles))
        self.drafter_device = torch.device(ddev[0])
        # On CUDA: fp32 master weights with bf16 autocast, and the queued states in bf16 (half the
        # queue memory); on the CPU everything is fp32.
        self.autocast = autocast_on(self.drafter_device.type)
        self.state_dtype = getattr(torch, state_dtype_name(self.drafter_device.type))

        t0 = time.perf_counter()
        self.target = target if target is not None else load_target(cfg.target.model, device=tdev[0])
        self.progress(f"target {self.target.source}: {self.target.num_layers} layers, hidden "
                      f"{self.target.hidden_size} (loaded in {time.perf_counter() - t0:.1f} s)")
        self.layer_ids = capture_layer_ids(self.target.num_layers, cfg.target.capture_layers)
        self.capture = HiddenStateCapture(self.target.model, self.layer_ids)
        self.data = TrainingData(cfg, self.target.tokenizer, conversations)
        self.sampler = self.data.sampler
        spec = DrafterSpec.from_target_config(self.target.config, target_layer_ids=self.layer_ids,
                                              mask_token_id=default_mask_token_id(self.target.tokenizer),
                                              drafter=cfg.drafter)
        torch.manual_seed(cfg.seed)
        self.drafter = DFlashDrafter.from_target(self.target.model, spec, device=self.drafter_device,
                                                 dtype=torch.float32)
        self.optimizer = build_optimizer(self.drafter.trainable_parameters(), cfg.train)
        self.scheduler = LrSchedule(self.optimizer, cfg.train)
        self.elapsed_before_s = 0.0  # training time of earlier sessions (from the checkpoint)
        self.new_phase: dict[str, Any] | None = None  # a schedule phase opened by extending a finished run
        self.skipped_no_anchors = 0  # items taken whose sequences had no anchor: no step, not trained
        self.clock: Callable[[], float] = time.perf_counter  # training time (tests drive it with a stub)
        self._wall0 = self.clock()
        self.anchor_gen = torch.Generator().manual_seed(cfg.seed)
        self.queue = HSQueue(cfg.queue, self.sampler.n_buckets, mix=self.sampler.item_mix(), seed=cfg.seed)
        self.start_step = 0
        self._control_serial = 0
        self.before: dict[str, int] = {"trained": 0, "skipped_no_anchors": 0}  # carried over from a checkpoint
        self.trained_conversations: set[str] = set()  # kept out of the acceptance-length prompts
        feed_state: dict[str, Any] = {"epoch": 0, "index": 0, "pending": []}
        if resume:
            feed_state = self._restore()
        self.feed = ItemFeed(self.sampler, cfg.train.epochs, feed_state["epoch"], feed_state["index"],
                             replay=feed_state["pending"])
        self.records = RecordWriter(self.out, self.run_id, "real")
        self._control = ControlWatch(self.out, self._control_serial)
        self._records_lock = threading.Lock()
        self._items_lock = threading.Lock()
        self._producers_left = len(tdev)
        if not resume:  # the run's own config: `--resume` and `tune-live` read it
            write_run_config(self.out, cfg)
        self._stop_signal: str | None = None
        self._errors: list[BaseException] = []
        self._refused_ids: list[str] = []  # finished by a producer after the stop: produced and discarded
        self._stage_totals: dict[str, list[float]] = {}  # name -> [sum, n] over the run
        self._step_stages: dict[str, float] = {}  # this step's stage times (summed over items, drafters)
        self.stages = StageTimer()  # per logging interval: mean and p95 of every stage, both roles
        self.mix = RollingMix(self.sampler.item_mix(), cfg.metrics.window)
        self.wandb_mode = wandb_mode

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self, step: int) -> Path:
        """Between steps: nothing is in a drafter's hands, so pending = queued + being produced."""
        import random

        tensors = {"drafter": self.drafter.state_dict(), "optimizer": self.optimizer.state_dict(),
                   "scheduler": self.scheduler.state_dict(), "anchor_gen": self.anchor_gen.get_state(),
                   "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}
        meta = {"step": step, "t": self.queue.now(), "run_id": self.run_id, "feed": self.feed.state(),
                "queue_core": self.queue._core.state_dict(), "queue_config": dict(self.queue.config.__dict__),
                "trained": self._trained_and_skipped()[0], "skipped_no_anchors": self._trained_and_skipped()[1],
                "elapsed_s": self.training_s(),
                "replayed": self.before.get("replayed", 0) + self.feed.replayed,
                "control_serial": self._control_serial}
        return write_checkpoint(self.out, tensors, meta)

    def _restore(self) -> dict[str, Any]:
        import random

        from dflash.core.config import QueueConfig
        from dflash.core.records import truncate_after_step

        ckpt, meta = latest_verified(self.out, warn=self.progress)
        tensors = load_state(ckpt)
        self.drafter.load_state_dict(tensors["drafter"])
        self.optimizer.load_state_dict(tensors["optimizer"])
        self.anchor_gen.set_state(tensors["anchor_gen"])
        torch.set_rng_state(tensors["torch_rng"])
        random.setstate(tensors["python_rng"])
        self.run_id = meta["run_id"]
        self.cfg = dataclasses.replace(self.cfg, queue=QueueConfig(**meta["queue_config"]))
        self.queue.reconfigure(self.cfg.queue)
        self.queue._core.load_state_dict(meta["queue_core"])
        self.start_step = int(meta["step"]) + 1
        self._control_serial = int(meta.get("control_serial", 0))
        self.before = {"trained": int(meta["trained"]), "replayed": int(meta.get("replayed", 0)),
                       "skipped_no_anchors": int(meta.get("skipped_no_anchors", 0))}
        self.elapsed_before_s = float(meta.get("elapsed_s", 0.0))
        if "schedule" in tensors["scheduler"]:  # (a checkpoint from before the schedule lived here starts anew)
            self.new_phase = self.scheduler.load_state_dict(tensors["scheduler"], step=self.start_step,
                                                            elapsed_s=self.elapsed_before_s, train=self.cfg.train)
        dropped = truncate_after_step(self.out, int(meta["step"]))
        taken = [i for r in read_records(self.out, "take") for i in r["item_ids"]]
        self.trained_conversations = {self.data.conversations[k].id for k in self.sampler.sequences_of(taken)}
        self.queue.continue_clock_from(float(meta["t"]))
        self.progress(f"resumed at step {self.start_step} from {ckpt}; replaying "
                      f"{len(meta['feed']['pending'])} items in flight; records dropped after the checkpoint: "
                      f"{dropped}")
        return meta["feed"]

    # ------------------------------------------------------------------ live re-tuning
    def poll_control(self, step: int) -> None:
        """Apply a new control file between takes: validated like any config, recorded either way."""
        from dflash.core.config import with_overrides
        from dflash.core.errors import ConfigError

        ctl, problem = self._control.poll()
        if problem is not None:
            with self._records_lock:
                self.records.write("control", t=self.queue.now(), accepted=False, change=rejected_change(None),
                                   step=step, serial=None, reason=problem)
            self.progress(f"live change rejected: {problem}")
        if ctl is None:
            return
        self._control_serial = ctl["serial"]
        change = ctl["queue"]
        try:
            if not isinstance(change, dict) or not change:
                raise ConfigError("control", "must hold a non-empty 'queue' table", change)
            cfg = with_overrides(self.cfg, {f"queue.{k}": v for k, v in change.items()})
        except (ConfigError, TypeError, ValueError) as exc:  # any content: rejected, recorded, the run goes on
            reason = exc.line() if isinstance(exc, ConfigError) else f"control: {exc}"
            with self._records_lock:
                self.records.write("control", t=self.queue.now(), accepted=False, change=rejected_change(change),
                                   step=step, serial=ctl["serial"], reason=reason)
            self.progress(f"live change #{ctl['serial']} rejected: {reason}")
            self.wb.event("queue_control", {"accepted": False, "serial": ctl["serial"]}, step=step)
            return
        self.cfg = cfg
        self.queue.reconfigure(cfg.queue)
        with self._records_lock:
            self.records.write("control", t=self.queue.now(), accepted=True, change=change, step=step,
                               serial=ctl["serial"], queue=dict(cfg.queue.__dict__))
        self.progress(f"live change #{ctl['serial']} applied before step {step}: {change}")
        self.wb.event("queue_control", {"accepted": True, "serial": ctl["serial"], **change}, step=step)

    # ------------------------------------------------------------------ target side
    def _next_item(self) -> ItemSpec | None:
        return self.feed.next()

    def make_item(self, spec: ItemSpec, device: torch.device) -> QueueItem:
        """Tokenise, pad and capture one item; the payload lives on the drafter's device and dtype."""
        from dflash.model.target import collate

        batch = [self.data.encode(i) for i in spec.seq_indices]
        pad = self.target.tokenizer.pad_token_id
        input_ids, attention_mask, loss_mask = collate(batch, pad if pad is not None else 0)
        t0 = time.perf_counter()
        hidden = self.capture(input_ids.to(device), attention_mask.to(device))
        self.stages.add("target_forward", time.perf_counter() - t0)
        t0 = time.perf_counter()
        hidden = hidden.to(self.drafter_device, self.state_dtype)
        self.stages.add("capture_transfer", time.perf_counter() - t0)
        payload = (hidden, input_ids.to(self.drafter_device), attention_mask.to(self.drafter_device),
                   loss_mask.to(self.drafter_device))
        return QueueItem(spec.item_id, spec.bucket, spec.n_seqs, spec.real_tokens, spec.padded_len,
                         hidden.numel() * hidden.element_size(), payload)

    def _producer(self, worker: int, device: str) -> None:
        try:
            while (spec := self._next_item()) is not None:
                t_start = self.queue.now()
                item = self.make_item(spec, torch.device(device))
                t_end = self.queue.now()
                t_put = time.perf_counter()
                blocked = self.queue.put(item, worker=worker, timeout=QUEUE_WAIT_S)
                self.stages.add("enqueue", time.perf_counter() - t_put)
                with self._records_lock:
                    self.records.write("produce", t=t_end, item_id=spec.item_id, worker=worker,
                                       bucket=spec.bucket, n_seqs=spec.n_seqs, real_tokens=spec.real_tokens,
                                       padded_len=spec.padded_len, t_start=t_start, t_end=t_end,
                                       blocked_s=blocked if blocked is not None else self.queue.now() - t_end,
                                       bytes=item.nbytes, rank=0, pid=os.getpid())
                if blocked is None:  # the run stopped: produced (recorded above), discarded, listed
                    self._refused_ids.append(spec.item_id)
                    return
        except BaseException as exc:  # surfaced by the drafter loop
            self._errors.append(exc)
            self.queue.stop()
        finally:
            with self._items_lock:
                self._producers_left -= 1
                last = self._producers_left == 0
            if last:
                self.queue.close()

    # ------------------------------------------------------------------ drafter side
    def _timed(self, name: str, t0: float) -> float:
        dt = time.perf_counter() - t0
        self._step_stages[name] = self._step_stages.get(name, 0.0) + dt
        total = self._stage_totals.setdefault(name, [0.0, 0])
        total[0] += dt
        total[1] += 1
        self.stages.add(name.removesuffix("_s"), dt)
        return dt

    def train_step(self, step: int) -> dict[str, Any] | None:
        """One synchronised step over every drafter worker; None when the data is drained."""
        takes: list[tuple[list[QueueItem], float, int, int, int]] = []  # items, compute_s, counted, anchors, d
        self._step_stages = {}
        loss_sum, weight, counted, anchors = 0.0, 0.0, 0, 0
        for d in range(self.cfg.cluster.n_drafter):
            t0 = time.perf_counter()
            items = self.queue.take(drafter=d, step=step, timeout=QUEUE_WAIT_S)
            self._timed("gate_wait_s", t0)
            if items is None:
                continue
            t1 = time.perf_counter()
            w_loss, w_weight, w_tokens, w_anchors = 0.0, 0.0, 0, 0
            for item in items:
                hidden, input_ids, attention_mask, loss_mask = item.payload
                tf = time.perf_counter()
                with torch.autocast(self.drafter_device.type, dtype=torch.bfloat16, enabled=self.autocast):
                    out = self.drafter.loss(hidden, input_ids, loss_mask, attention_mask, generator=self.anchor_gen)
                self._timed("drafter_forward_s", tf)
                tb = time.perf_counter()
                out.loss_sum.backward()  # unnormalised; divided by the global weight below
                self._timed("backward_s", tb)
                w_loss += float(out.loss_sum.detach())
                w_weight += out.weight_sum
                w_tokens += out.tokens
                w_anchors += out.anchors
            compute = time.perf_counter() - t1
            loss_sum += w_loss
            weight += w_weight
            counted += w_tokens
            anchors += w_anchors
            takes.append((items, compute, w_tokens, w_anchors, d))
        if not takes:
            return None
        if weight <= 0:  # no anchor in any take: no optimizer step, the schedule does not advance
            self.optimizer.zero_grad(set_to_none=True)
            self._finish_takes(takes)
            return {"takes": takes, "skipped": True}
        to = time.perf_counter()
        for p in self.drafter.trainable_parameters():
            if p.grad is not None:
                p.grad.div_(weight)  # upstream's normalisation: the sum of the weights of the valid positions
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.drafter.trainable_parameters(),
                                                         self.cfg.train.grad_clip))
        lr = self.scheduler.at(step, self.training_s())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._timed("optimizer_s", to)
        self._finish_takes(takes)
        return {"takes": takes, "loss": loss_sum / weight, "counted": counted,
                "anchors": anchors, "lr": lr, "grad_norm": grad_norm,
                "tokens": sum(i.real_tokens for items, *_ in takes for i in items)}

    def _finish_takes(self, takes: list[tuple[list[QueueItem], float, int, int, int]]) -> None:
        for items, *_ in takes:
            self.queue.task_done(items)
            self.feed.trained(i.item_id for i in items)
            self.trained_conversations.update(
                self.data.conversations[k].id for k in self.sampler.sequences_of(i.item_id for i in items))

    def _trained_and_skipped(self) -> tuple[int, int]:
        """Items trained and items skipped for want of anchors, every session (the queue counts both as done)."""
        done = self.queue.stats()["trained"]
        return (self.before["trained"] + done - self.skipped_no_anchors,
                self.before["skipped_no_anchors"] + self.skipped_no_anchors)

    def training_s(self) -> float:
        """Training time of the run, every session (what ``max_minutes`` and the schedule count)."""
        return self.elapsed_before_s + self.clock() - self._wall0

    def _write_takes(self, step_out: dict[str, Any]) -> None:
        """Take records: the queue's own log entries plus what only the drafter knows (compute)."""
        log = self.queue.drain_take_log()
        by_drafter = {(e.drafter, e.step): e for e in log}
        for items, compute, tokens, anchors, d in step_out["takes"]:
            e = by_drafter.get((d, step_out["step"]))
            if e is None:
                continue
            rec = e.as_record()
            rec.pop("kind")
            self.mix.add_take(e.bucket, [i.padded_len for i in items])
            self.records.write("take", **rec, compute_s=compute, tokens=sum(i.real_tokens for i in items),
                               n_seqs=sum(i.n_seqs for i in items), anchors=anchors, counted_tokens=tokens)

    # ------------------------------------------------------------------ the run
    def run(self) -> TrainResult:
        """Train until max_steps / max_minutes / end of data / a signal; W&B and NVML around it."""
        cfg = self.cfg
        self.gpus = NvmlSampler(5.0, clock=self.queue.now, warn=self.progress).start()
        self.wb = WandbLogger(self.wandb_mode, self.out, cfg.to_dict(), self.run_id, warn=self.progress)
        try:
            return self._run()
        finally:
            self.gpus.stop()
            sync = self.wb.sync_command  # known only while the W&B run is open
            self.wb.finish()
            if sync:
                self.progress(f"W&B offline run: upload later with `{sync}`")

    def _telemetry(self, out: dict[str, Any], tokens_per_s: float, samples_per_s: float) -> dict[str, Any]:
        """One logging interval's values, for W&B and the step record alike."""
        now = self.queue.now()
        health = queue_health(self.queue, self._health_prev, max(now - self._health_t, 1e-9),
                              n_drafter=self.cfg.cluster.n_drafter, n_target=len(self.cfg.target.devices))
        self._health_prev, self._health_t = health, now
        return {"loss": out["loss"], "lr": out["lr"], "grad_norm": out["grad_norm"], "tokens_per_s": tokens_per_s,
                "samples_per_s": samples_per_s, **health, **self.mix.metrics(), **self.stages.metrics(),
                **gpu_metrics(self.gpus.drain())}

    def _run(self) -> TrainResult:
        cfg = self.cfg
        max_steps = cfg.train.max_steps
        max_s = cfg.train.max_minutes * 60 if cfg.train.max_minutes else None
        threads = [threading.Thread(target=self._producer, args=(w, dev), daemon=True, name=f"target-{w}")
                   for w, dev in enumerate(cfg.target.devices)]
        for t in threads:
            t.start()
        losses: list[float] = []
        step = self.start_step
        wall0 = time.perf_counter()
        self._wall0 = self.clock()
        last_log = wall0
        stopped_by = "data"
        interval_tokens = interval_seqs = 0
        self._health_prev: dict[str, Any] | None = None
        self._health_t = self.queue.now()
        self._install_signal_handlers()
        if self.new_phase is not None:
            self.progress(f"learning-rate schedule: a new phase for the extended run: {self.new_phase}")
        with self._records_lock:
            self.records.write("control", t=self.queue.now(), accepted=True, step=step,
                               change={"start": dict(cfg.queue.__dict__)},
                               reason="resumed queue config" if self.start_step else "initial queue config")
        while True:
            if self._stop_signal is not None:
                stopped_by = self._stop_signal
                break
            if max_steps is not None and step >= max_steps:
                stopped_by = "max_steps"
                break
            if max_s is not None and self.training_s() >= max_s:
                stopped_by = "max_minutes"
                break
            self.poll_control(step)
            ts = time.perf_counter()
            out = self.train_step(step)
            if self._errors:
                raise RuntimeError("a target worker failed") from self._errors[0]
            if out is None:
                break
            if out.get("skipped"):  # a take without anchors: counted, not a step
                self.skipped_no_anchors += sum(len(items) for items, *_ in out["takes"])
                self.queue.drain_take_log()
                continue
            out["step"] = step
            step_s = time.perf_counter() - ts
            interval_tokens += out["tokens"]
            interval_seqs += sum(i.n_seqs for items, *_ in out["takes"] for i in items)
            now = time.perf_counter()
            log_now = (step + 1) % cfg.train.log_every == 0 or now - last_log > 30
            evaluation = self.evaluate(step) if cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0 \
                else None
            telemetry = None
            with self._records_lock:
                self._write_takes(out)
                if log_now:
                    telemetry = self._telemetry(out, interval_tokens / (now - last_log),
                                                interval_seqs / (now - last_log))
                self.records.write("step", t=self.queue.now(), step=step, loss=out["loss"], lr=out["lr"],
                                   anchors=out["anchors"], tokens=out["tokens"], counted_tokens=out["counted"],
                                   grad_norm=out["grad_norm"], step_s=step_s,
                                   stages=dict(self._step_stages), telemetry=telemetry,
                                   eval=evaluation)
            losses.append(out["loss"])
            if (step + 1) % cfg.train.checkpoint_every == 0:
                self.checkpoint(step)
            if telemetry is not None:
                self.wb.log(telemetry, step=step)
                loss_txt = f"{out['loss']:.4f}" if math.isfinite(out["loss"]) else "n/a (no anchors)"
                self.progress(f"step {step + 1:>5}  loss {loss_txt}  lr {out['lr']:.2e}  "
                              f"tokens/s {telemetry['tokens_per_s']:,.0f}  queue depth {self.queue.qsize()} "
                              f"{self.queue.bucket_sizes()}  mix_efficiency(rolling) "
                              f"{telemetry.get('mix_efficiency', float('nan')):.3f}")
                last_log, interval_tokens, interval_seqs = now, 0, 0
            step += 1
        if step > self.start_step:
            self.checkpoint(step - 1)  # before the stop discards anything: queued items stay pending
        close_t = self.queue.now()
        discarded = self.queue.stop()
        for t in threads:
            t.join(QUEUE_WAIT_S)
        if self._errors:
            raise RuntimeError("a target worker failed") from self._errors[0]
        stats = self.queue.stats()
        trained, skipped = self._trained_and_skipped()
        summary = {"produced": self.before["trained"] + self.before["skipped_no_anchors"] + stats["produced"],
                   "trained": trained, "skipped_no_anchors": skipped, "discarded_at_stop": stats["discarded_at_stop"],
                   "replayed": self.before.get("replayed", 0) + self.feed.replayed, "steps": step,
                   "stopped_by": stopped_by, "wall_s": time.perf_counter() - wall0,
                   "discarded_ids": [i.item_id for i in discarded] + self._refused_ids, "queue_stats": stats,
                   "stage_means_s": {k: tot / n for k, (tot, n) in self._stage_totals.items() if n}}
        with self._records_lock:
            self.records.write("summary", t=close_t, **summary)
        self.records.close()
        metrics = self.metrics(close_t)
        step_losses = [r.get("loss") for r in read_records(self.out, "step")]
        metrics.update(loss_roughness(step_losses, first_step=len(step_losses) // 2))  # the run's second half
        (self.out / "metrics.json").write_text(json.dumps(clean_json(metrics), indent=1))
        self.drafter.save(self.out / "drafter")
        export_parquet(self.out)
        return TrainResult(self.out, summary, metrics, losses)

    def evaluate(self, step: int) -> dict[str, Any]:
        """Acceptance length tau on prompts of conversations not trained on so far."""
        from dflash.model.acceptance import evaluate_acceptance, render_prompt, select_heldout

        c = self.cfg.train
        chosen = select_heldout(self.data.conversations, c.eval_prompts, self.cfg.seed + 1,
                                skip_ids=self.trained_conversations)
        prompts = [render_prompt(self.target.tokenizer, conv) for conv in chosen]
        self.drafter.eval()
        try:
            res = evaluate_acceptance(self.target, self.drafter, prompts, max_new_tokens=c.eval_new_tokens)
        finally:
            self.drafter.train()
        summary = {"tau": res["tau"], "acceptance_rate_per_position": res["acceptance_rate_per_position"],
                   "prompts": res["num_prompts"], "tokens_per_s": res["tokens_per_s"]}
        self.wb.log({"eval/tau": res["tau"]}, step=step)
        self.progress(f"eval after step {step + 1}: tau {res['tau']:.3f} on {res['num_prompts']} held-out prompts")
        return summary  # goes into this step's record

    def _install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT: finish the step, checkpoint, stop cleanly (main thread only)."""
        import signal

        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, _frame: Any) -> None:
            self._stop_signal = f"signal {signal.Signals(signum).name}"

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)

    def metrics(self, close_t: float) -> dict[str, Any]:
        trace = RunTrace.from_records(list(read_records(self.out, "produce")), list(read_records(self.out, "take")))
        c = self.cfg
        return run_metrics(trace, p=self.sampler.item_mix(), min_ready=c.queue.min_ready, window=c.metrics.window,
                           warmup_s=c.metrics.warmup_s, close_t=close_t, n_target=len(c.target.devices),
                           n_drafter=c.cluster.n_drafter, n_buckets=self.sampler.n_buckets)
