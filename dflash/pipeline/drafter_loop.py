"""A drafter rank's run: steps until the ranks agree to stop, checkpoints and the end of run on the host rank.

Every drafter rank runs the same sequence of collectives (stop agreement, weight sums, gradient
sums), so the ranks stay in step. The host rank (which hosts the coordinator) also writes the
checkpoints (the coordinator's snapshot, taken once the ledger holds the step), logs progress and
W&B, and at the end writes metrics.json, the drafter and the Parquet export.
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash.model.flops import peak_for, step_efficiency
from dflash.model.hostsync import total as host_syncs
from dflash.pipeline.checkpoint import write_checkpoint
from dflash.pipeline.context import DrafterContext
from dflash.pipeline.messages import Bye, Done
from dflash.pipeline.roles import shares_gpu
from dflash.pipeline.workers import STOP_MAX_STEPS, STOP_NONE, DrafterWorker

if TYPE_CHECKING:
    from dflash.pipeline.hold import HoldWatch
    from dflash.pipeline.telemetry import WandbLogger


class DrafterLoop:
    """One drafter rank's steps; it reads only its :class:`DrafterContext` (and the worker it drives)."""

    def __init__(self, dc: DrafterContext, worker: DrafterWorker) -> None:
        self.dc, self.ctx, self.worker = dc, dc.rank, worker
        self.host = self.ctx.roles.is_coordinator
        self.cfg = self.ctx.cfg
        self.stage_totals: dict[str, list[float]] = {}
        self.losses: list[float] = []
        self.elapsed_s = 0.0  # training time, all sessions (the ranks agree on it every step)
        self.held_s = 0.0  # time spent holding between validation blocks (not training time)
        self.hold = _hold_watch(self.ctx.out) if self.host else None
        # dense bf16 peak of this rank's GPU (by the name NVML and CUDA report); None on the CPU: no MFU
        device = self.ctx.device
        self.peak = peak_for(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        self.eval_skip_said = False  # train.eval_every on a placement it cannot run on: said once
        self.heldout = None  # train.quality_every: the held-out metric (dflash.pipeline.heldout), host rank
        if self.host and self.cfg.train.quality_every is not None:
            from dflash.pipeline.heldout import HeldoutScorer

            self.heldout = HeldoutScorer(self.ctx, dc.corpus, dc.drafter)

    def run(self) -> None:
        dc, ctx, w, train = self.dc, self.ctx, self.worker, self.cfg.train
        start = step = dc.start.step
        wall0 = last_log = time.perf_counter()
        interval_tokens, stopped_by, last_ckpt = 0, "data", None
        wb = self._wandb() if self.host else None
        before_s = self.before_s = dc.scheduler.elapsed_s  # training time of earlier sessions
        self.wall0 = wall0
        if self.host and dc.new_phase is not None:
            dc.host_service.note("learning-rate schedule: a new phase for the extended run", dc.new_phase)
        try:
            while True:
                mine = before_s + time.perf_counter() - wall0 - self.held_s if self.host else 0.0
                local = ctx.stop.local(step, mine)
                if local == STOP_NONE and self.hold is not None and self.hold.due(step):
                    if step > start and last_ckpt != step - 1:
                        self.checkpoint(step - 1)  # the block's end: its records are on disk
                        last_ckpt = step - 1
                    stop = self._hold_between_blocks(step)
                    mine = before_s + time.perf_counter() - wall0 - self.held_s
                    local = STOP_MAX_STEPS if stop else ctx.stop.local(step, mine)
                syncs0 = host_syncs()  # issue 34: at most one host read of the device per step
                code, self.elapsed_s = w.agree_stop(local, mine)
                if code != STOP_NONE:
                    stopped_by = ctx.stop.name(code)
                    break
                dc.scheduler.at(step, self.elapsed_s)
                ts = time.perf_counter()
                got = w.step(step)
                if got is None:
                    break
                res, info = got
                info["step_s"] = time.perf_counter() - ts
                info["host_syncs"] = host_syncs() - syncs0
                info["shared_gpu"] = shares_gpu(ctx.plane)
                info.update(step_efficiency(info["model_flops"], info["step_s"], self.peak,
                                            torch.distributed.get_world_size(w.group)))
                self._add_stages(res.stages)
                skipped = info.pop("skipped")  # no anchor in any take: not a step (the same number again)
                if self.host and not skipped and train.eval_every and (step + 1) % train.eval_every == 0:
                    info["eval"] = self.evaluate(step, wb)  # into this step's record
                if self.heldout is not None and not skipped and self.heldout.due(step):
                    info["heldout"] = self.heldout.score(step, wb)
                ctx.channel.send(Done(step, os.getpid(), tuple(res.takes), res.stages, info if self.host else None,
                                      ctx.gpu_samples(), skipped, socket.gethostname(), str(ctx.device)))
                if skipped:
                    continue
                if self.host:
                    self.losses.append(info["loss"])
                    interval_tokens += info["tokens"]
                    now = time.perf_counter()
                    if (step + 1) % train.log_every == 0 or now - last_log > 30:
                        self._log(step, info, interval_tokens / max(now - last_log, 1e-9), wb)
                        last_log, interval_tokens = now, 0
                    if (step + 1) % train.checkpoint_every == 0:
                        self.checkpoint(step)
                        last_ckpt = step
                step += 1
            if self.host and step > start and last_ckpt != step - 1:
                self.checkpoint(step - 1)  # before the stop discards anything: queued items stay pending
            summary = None
            if self.host:
                summary = {"steps": step, "stopped_by": stopped_by, "wall_s": time.perf_counter() - wall0,
                           "data_plane": ctx.plane, "shared_gpu": shares_gpu(ctx.plane),
                           "stage_means_s": {k: tot / n for k, (tot, n) in self.stage_totals.items() if n}}
            ctx.channel.send(Bye(summary=summary))
            if self.host:
                self._finish()
                if self.hold is not None:
                    from dflash.pipeline.hold import write_held

                    write_held(ctx.out, self.hold.block.serial, step, ended=True)
        finally:
            if wb is not None:
                sync = wb.sync_command
                wb.finish()
                if sync:
                    ctx.progress(f"W&B offline run: upload later with `{sync}`")
        ctx.status("finished")

    def _hold_between_blocks(self, step: int) -> bool:
        """Host rank at a validation block's end: pause the producers, say so in held.json (renewed while
        holding), wait for the next block; True when told to stop (or left alone for HOLD_TIMEOUT_S).
        The other drafter ranks wait in the next stop agreement meanwhile (held jobs run with a
        process-group timeout longer than the hold)."""
        from dflash.pipeline.hold import BEAT_S, HOLD_TIMEOUT_S, write_held

        ctx, hold, service = self.ctx, self.hold, self.dc.host_service
        assert hold is not None
        t0 = time.perf_counter()
        service.pause(ctx.wait_s)
        ctx.status(f"holding after block {hold.block.serial} at step {step}")
        try:
            while not hold.block.stop:
                write_held(ctx.out, hold.block.serial, step)
                nxt = self._next_block(BEAT_S)
                if ctx.signal is not None:
                    return False  # the signal ends the run as a signal does
                if time.perf_counter() - t0 > HOLD_TIMEOUT_S:
                    return True  # the driver is gone: end cleanly (checkpoint, metrics, drafter)
                if nxt is not None and not hold.due(step):
                    return False  # the next block: train on
            return True
        finally:
            service.unpause()
            self.held_s += time.perf_counter() - t0

    def _next_block(self, within_s: float) -> Any:
        assert self.hold is not None
        deadline = time.perf_counter() + within_s
        while time.perf_counter() < deadline and self.ctx.signal is None:
            nxt = self.hold.next_block()
            if nxt is not None:
                return nxt
            time.sleep(0.05)
        return None

    def _add_stages(self, stages: dict[str, float]) -> None:
        for k, v in stages.items():
            tot = self.stage_totals.setdefault(k, [0.0, 0])
            tot[0] += v
            tot[1] += 1

    def _wandb(self) -> WandbLogger:
        from dflash.pipeline.telemetry import WandbLogger

        return WandbLogger(self.dc.wandb, self.ctx.out, self.cfg.to_dict(), self.dc.start.run_id,
                           warn=self.ctx.progress)

    def _log(self, step: int, info: dict[str, Any], tokens_per_s: float, wb: WandbLogger | None) -> None:
        service = self.dc.host_service
        q = service.coord.state()
        loss = info["loss"]
        metrics = {"loss": loss, "lr": info["lr"], "grad_norm": info["grad_norm"], "tokens_per_s": tokens_per_s,
                   "hs_depth": q["depth"], "queued_bytes": q["queued_bytes"],
                   **{k: info[k] for k in ("flops_per_s", "mfu") if info.get(k) is not None},
                   **{f"hs_depth/bucket_{i}": d for i, d in enumerate(q["bucket_depths"])},
                   **{f"resident_bytes/rank_{r}": b for r, b in enumerate(q["resident_bytes_per_producer"])},
                   **{f"stage/{k.removesuffix('_s')}_mean": tot / n for k, (tot, n) in self.stage_totals.items()
                      if n}, **service.last_telemetry}
        mix = service.mix.metrics()
        per_take = service.queue.items_per_take
        window = self.cfg.metrics.window
        if mix["mix_items"] < window:  # a rolling metric exists once a window of items was taken
            mix_txt = f"n/a (needs {math.ceil(window / per_take)} takes)"
        elif math.isfinite(mix["mix_efficiency"]):
            metrics.update({f"rolling/{k}": v for k, v in mix.items() if k != "mix_items"})
            mix_txt = f"{mix['mix_efficiency']:.3f}"
        else:
            mix_txt = "n/a (one bucket in the item mix)"
        if wb is not None:
            wb.log(metrics, step=step)
        loss_txt = f"{loss:.4f}" if math.isfinite(loss) else "n/a (no anchors)"
        self.ctx.progress(f"step {step + 1:>5}  loss {loss_txt}  lr {info['lr']:.2e}  tokens/s {tokens_per_s:,.0f}  "
                         f"queue depth {q['depth']} {q['bucket_depths']}  mix_efficiency(rolling) {mix_txt}  "
                          f"ranks {self.ctx.roles.world_size}")

    def evaluate(self, step: int, wb: WandbLogger | None) -> dict[str, Any] | None:
        """Acceptance length tau (real speculative decoding) on prompts of conversations not trained so far.

        Host rank only; the other drafter ranks wait for it in the next step's stop agreement. It needs
        the target and the drafter on one device: a drafter rank keeps its target copy on the CPU, so on a
        GPU this says once that it is skipped (``dflash eval`` after training measures the same thing).
        """
        from dflash.core.records import read_records
        from dflash.model.acceptance import evaluate_acceptance, render_prompt, select_heldout

        ctx, dc, corpus, c = self.ctx, self.dc, self.dc.corpus, self.cfg.train
        if next(dc.drafter.parameters()).device != next(corpus.target.model.parameters()).device:
            if not self.eval_skip_said:
                ctx.progress("train.eval_every: skipped on this placement (the drafter rank holds the target on the "
                            "CPU); measure tau after training with dflash eval")
                self.eval_skip_said = True
            return None
        taken = [i for r in read_records(ctx.out, "take") for i in r["item_ids"]]
        used = {corpus.data.conversations[k].id for k in corpus.sampler.sequences_of(taken)}
        chosen = select_heldout(corpus.data.conversations, c.eval_prompts, self.cfg.seed + 1, skip_ids=used)
        prompts = [render_prompt(corpus.target.tokenizer, conv) for conv in chosen]
        dc.drafter.eval()
        try:
            res = evaluate_acceptance(corpus.target, dc.drafter, prompts, max_new_tokens=c.eval_new_tokens)
        finally:
            dc.drafter.train()
        if wb is not None:
            wb.log({"eval/tau": res["tau"]}, step=step)
        ctx.progress(f"eval after step {step + 1}: tau {res['tau']:.3f} on {res['num_prompts']} held-out prompts")
        return {"tau": res["tau"], "acceptance_rate_per_position": res["acceptance_rate_per_position"],
                "prompts": res["num_prompts"], "tokens_per_s": res["tokens_per_s"]}

    def checkpoint(self, step: int) -> None:
        """The drafter's state and the coordinator's snapshot at ``step`` (after the ledger committed it)."""
        ctx, dc = self.ctx, self.dc
        snap = dc.host_service.snapshot(step, ctx.wait_s)
        tensors = {"drafter": dc.drafter.state_dict(), "optimizer": dc.optimizer.state_dict(),
                   "scheduler": dc.scheduler.state_dict(),
                   "elapsed_s": self.before_s + time.perf_counter() - self.wall0,
                   "torch_rng": torch.get_rng_state(),
                   "python_rng": random.getstate()}
        meta = {"step": step, "run_id": dc.start.run_id, "world": {"n_target": ctx.roles.n_target,
                                                                   "n_drafter": ctx.roles.n_drafter}, **snap}
        write_checkpoint(ctx.out, tensors, meta)

    def _finish(self) -> None:
        """Host rank: the summary (once every rank said bye), metrics.json, the drafter, Parquet."""
        from dflash.core.records import clean_json, export_parquet, read_records
        from dflash.core.runmetrics import RunTrace, loss_roughness, run_metrics

        ctx, dc, cfg, roles = self.ctx, self.dc, self.cfg, self.ctx.roles
        service, sampler, out = dc.host_service, dc.corpus.sampler, ctx.out
        summary = service.join(ctx.wait_s)
        trace = RunTrace.from_records(list(read_records(out, "produce")), list(read_records(out, "take")))
        # the knobs in force (tune-live and the autopilot move them), not the ones the run started with
        metrics = run_metrics(trace, p=sampler.item_mix(), min_ready=service.coord.min_ready_schedule(),
                              window=cfg.metrics.window,
                              warmup_s=cfg.metrics.warmup_s, close_t=service.close_t, n_target=roles.n_target,
                              n_drafter=roles.n_drafter, n_buckets=sampler.n_buckets)
        step_losses = [r.get("loss") for r in read_records(out, "step")]
        metrics.update(loss_roughness(step_losses, first_step=len(step_losses) // 2))
        (out / "metrics.json").write_text(json.dumps(clean_json(metrics), indent=1))
        dc.drafter.save(out / "drafter")
        export_parquet(out)
        s = summary
        ctx.progress(f"done: {s['steps']} steps in {s['wall_s']:.0f} s on {roles.world_size} ranks "
                     f"({roles.n_target} target + {roles.n_drafter} drafter; stopped by {s['stopped_by']}); "
                     f"produced {s['produced']} = trained {s['trained']} + skipped_no_anchors "
                     f"{s['skipped_no_anchors']} + discarded_at_stop {s['discarded_at_stop']}"
                     + (f"; replayed {s['replayed']}" if s.get("replayed") else ""))
        ctx.progress(f"drafter weights: {out / 'drafter'}; records: {out}")
        ctx.progress(f"export for serving: dflash export --drafter {out} --out {out / 'export'}")


def _hold_watch(out: Path) -> HoldWatch | None:
    """A job started by validation to hold between its blocks reads block.json (dflash.pipeline.hold)."""
    from dflash.pipeline.hold import BLOCK_FILE, HOLD_ENV, HoldWatch

    if os.environ.get(HOLD_ENV) != "1" or not (out / BLOCK_FILE).exists():
        return None
    return HoldWatch(out)
