"""The coordinator thread: the one :class:`Coordinator`, its control channel, the feed, records and ledger.

It runs on the first drafter rank. It owns everything that must have one writer: the item feed
(which item each producer computes next), the queue decisions, the run's records (``produce``,
``take``, ``step``, ``control``, ``summary``) and the ack ledger. It reads the control channel, applies
every ready report of a poll before serving takes (puts before takes), forwards each assignment to
its producer (send in round r) and drafter (receive in round r), commits each optimizer step's item
ids to the ledger once every drafter reported it, and applies ``tune-live`` changes between takes.
A checkpoint (written by its host drafter rank) takes :meth:`snapshot`, which waits for the ledger
to reach the checkpoint's step.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash.core.config import DflashConfig, QueueConfig, with_overrides
from dflash.core.errors import ConfigError
from dflash.core.queue_core import QueueItem
from dflash.core.records import RecordWriter
from dflash.core.sampler import Sampler
from dflash.pipeline import messages as m
from dflash.pipeline.abort import FAILURE, LOST_PEER_GRACE_S, heartbeat_timeout_s, left_a_reason
from dflash.pipeline.channel import ChannelError, Hub, LostRank
from dflash.pipeline.checkpoint import ControlWatch, ItemFeed, rejected_change
from dflash.pipeline.coordinator import Admit, Assignment, Coordinator, NoWork
from dflash.pipeline.faults import fault
from dflash.pipeline.ledger import Ledger
from dflash.pipeline.roles import Roles

if TYPE_CHECKING:
    from dflash.core.autopilot import Autopilot
    from dflash.pipeline.planes import PlaneMap

CONTROL_POLL_S = 0.25  # how often the control file is read (between takes)


class RankFailed(RuntimeError):
    """A rank told the coordinator it failed (:class:`~dflash.pipeline.messages.Failed`): the run aborts."""


@dataclasses.dataclass
class ResumeState:
    """What the service restores from a checkpoint (defaults: a fresh run)."""

    feed: dict[str, Any] = dataclasses.field(default_factory=lambda: {"epoch": 0, "index": 0, "pending": []})
    t: float = 0.0
    queue_core: dict[str, Any] | None = None
    counts: dict[str, int] = dataclasses.field(default_factory=lambda: {"trained": 0, "replayed": 0})
    control_serial: int = 0
    queue_config: dict[str, Any] | None = None  # the queue as it was at the checkpoint (live changes kept)
    autopilot: dict[str, Any] | None = None  # the queue autopilot's state ([queue] mode = "auto")


_PUTS = (m.NextItem, m.Ready, m.Closed)  # a poll's producer messages go first: puts before takes


@dataclasses.dataclass(frozen=True)
class _ReadyItem:
    """A ready report and when it was computed, kept until the item is put (its produce record)."""

    ready: m.Ready
    rank: int
    t_start: float
    t_end: float


class RankTelemetry:
    """Each rank's stage timings and GPU samples over a logging interval (``rank/<r>/...`` names)."""

    def __init__(self) -> None:
        self._stages: dict[int, dict[str, list[float]]] = {}
        self._gpu: dict[int, list[dict[str, Any]]] = {}

    def add(self, rank: int, stages: dict[str, float], gpu: list[dict[str, Any]] | None) -> None:
        per = self._stages.setdefault(rank, {})
        for k, v in stages.items():
            acc = per.setdefault(k, [0.0, 0])
            acc[0] += v
            acc[1] += 1
        if gpu:
            self._gpu.setdefault(rank, []).extend(gpu)

    def interval(self) -> dict[str, float]:
        from dflash.pipeline.telemetry import gpu_metrics

        out: dict[str, float] = {}
        for rank, per in sorted(self._stages.items()):
            for k, (tot, n) in per.items():
                out[f"rank/{rank}/stage/{k.removesuffix('_s')}_mean"] = tot / n if n else math.nan
        for rank, samples in sorted(self._gpu.items()):
            out.update({f"rank/{rank}/{k}": v for k, v in gpu_metrics(samples).items()})
        self._stages.clear()
        self._gpu.clear()
        return out


class CoordinatorService:
    """The coordinator thread's state and loop; ``start()`` runs it, ``join()`` waits for the summary."""

    def __init__(self, cfg: DflashConfig, roles: Roles, sampler: Sampler, out: Path, run_id: str, *,
                 resume: ResumeState, wait_s: float, progress: Callable[[str], None],
                 placement: PlaneMap | None = None, bind: str = "0.0.0.0") -> None:
        if resume.queue_config is not None:
            cfg = dataclasses.replace(cfg, queue=QueueConfig(**resume.queue_config))
        self.cfg, self.roles, self.out, self.wait_s, self.progress = cfg, roles, out, wait_s, progress
        self.placement = placement  # each rank's node and local rank, each pair's plane (dflash.pipeline.planes)
        self.sampler = sampler
        self.coord = Coordinator(cfg.queue, sampler.n_buckets, roles.n_target, roles.n_drafter,
                                 mix=sampler.item_mix(), seed=cfg.seed, sync=cfg.cluster.drafter_sync)
        if resume.queue_core is not None:
            self.coord.core.load_state_dict(resume.queue_core)
        if cfg.queue.mode == "auto":
            self.coord.autopilot = self._new_autopilot(cfg)
            if resume.autopilot is not None:
                self.coord.autopilot.load_state_dict(resume.autopilot)
        self.feed = ItemFeed(sampler, cfg.train.epochs, resume.feed["epoch"], resume.feed["index"],
                             replay=resume.feed["pending"])
        self.before = dict(resume.counts)
        self.control = ControlWatch(out, resume.control_serial)
        self.hub = Hub(bind)
        self.records = RecordWriter(out, run_id, "real")
        self.ledger = Ledger(out)
        self._t0 = time.monotonic() - resume.t
        self._lock = threading.Condition()
        self._items: dict[str, _ReadyItem] = {}  # ready report of each queued/blocked item
        self._assigned: dict[int, Assignment] = {}  # drafter -> its take of the current step
        self._done: dict[int, dict[int, m.Done]] = {}  # step -> drafter -> its done report
        self._byes: dict[int, m.Bye] = {}
        self._closed_producers: set[int] = set()
        self.produced = 0  # items put into the queue in this session
        self.trained = 0
        self.skipped = 0  # items of steps whose takes held no anchor (no optimizer step, no ledger step)
        self.discarded: list[str] = []
        self.summary: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.error_t: float | None = None  # when the coordinator thread failed (the host rank names it as the cause)
        self._failing: tuple[float, RankFailed] | None = None  # a rank's failure, raised once its grace ends (_poll)
        self._thread = threading.Thread(target=self._main, name="coordinator", daemon=True)
        self._last_control_poll = 0.0
        self.producer_blocked_s = 0.0
        self.drafter_wait_s = 0.0
        self.telemetry = RankTelemetry()
        from dflash.pipeline.telemetry import RollingMix

        self.mix = RollingMix(sampler.item_mix(), cfg.metrics.window)  # the step line's rolling mix metrics
        self.last_telemetry: dict[str, float] = {}  # the latest logging interval's per-rank values (W&B)
        self._paused = False  # holding between validation blocks (dflash.pipeline.hold): no admits
        self._pause_t = 0.0
        self._parked: list[int] = []  # producers waiting for their admit while paused
        self._computing: set[int] = set()  # producers admitted to compute an item not yet reported ready

    def _new_autopilot(self, cfg: DflashConfig) -> Autopilot:
        from dflash.core.autopilot import Autopilot, AutopilotConfig

        return Autopilot(AutopilotConfig.for_run(cfg, self.sampler.item_mix(), self.roles.n_target,
                                                 self.roles.n_drafter))

    @property
    def queue(self) -> QueueConfig:
        """The queue's knobs in force (live changes and autopilot decisions included): every reader of the
        knobs (checkpoints, live changes, the run's metrics and summary) asks here. ``cfg.queue`` is only
        where the run (or this session, after a resume) started."""
        return self.coord.config

    def _write_decisions(self) -> None:
        """The autopilot's changes since the last look, as control records with their reasons."""
        for rec in self.coord.controls:
            rec = dict(rec)
            self.records.write("control", t=rec.pop("t"), step=None, **rec)
            self.progress(f"queue autopilot: {rec['change']} ({rec['reason'].get('rule', 'decision')})")
        self.coord.controls.clear()

    # ------------------------------------------------------------------ lifecycle
    def now(self) -> float:
        return time.monotonic() - self._t0

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> dict[str, Any]:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the coordinator did not finish within {timeout} s")
        if self.error is not None:
            raise RuntimeError(f"coordinator failed: {self.error}") from self.error
        assert self.summary is not None
        return self.summary

    def _main(self) -> None:
        try:
            silent_s = heartbeat_timeout_s()
            self.hub.accept(list(range(self.roles.world_size)), self.wait_s)
            seen = dict.fromkeys(range(self.roles.world_size), time.monotonic())  # each rank's last message
            self._name_nodes()
            self._write_control_start()
            self._apply_control(step=None, at_start=True)
            while len(self._byes) < self.roles.world_size:
                msgs = self._poll()
                if self._failing is not None:
                    if time.monotonic() >= self._failing[0]:
                        raise self._failing[1]
                    continue
                if msgs:
                    fault("coordinator.handle")
                now = time.monotonic()
                for rank, _ in msgs:
                    seen[rank] = now
                self._check_alive(seen, now, silent_s)
                with self._lock:
                    self._handle(msgs)
                    self._lock.notify_all()
        except BaseException as exc:
            self.error, self.error_t = exc, time.time()
            with self._lock:
                self._lock.notify_all()
            FAILURE.fail(exc, "the coordinator thread")  # the host rank leaves, even if its main thread is blocked
        finally:
            self.records.close()
            self.ledger.close()
            self.hub.close()

    def _poll(self) -> list[tuple[int, m.Message]]:
        """The ready messages. Once a rank has failed (``_failing``), a channel that closes without its rank
        leaving a line of its own is a rank that vanished (killed, its node lost), and that is the cause: the
        failure reported first is usually its echo (a collective with it broke), and the line must name the
        lost rank and its node (``rank 2 (node 1: ranks 2, 3) closed its control channel``) whichever rank
        noticed first. A rank that left with a line after the failure is not a cause."""
        try:
            return self.hub.poll(0.05)
        except LostRank as lost:
            if self._failing is None or not left_a_reason(self.out, lost.rank):
                raise
            self.hub.retire(lost.rank)
            return []

    def wait_error(self, timeout: float) -> BaseException | None:
        """The coordinator thread's failure, waiting up to ``timeout`` for one: the host rank's own failure may
        be the echo of a rank that vanished, which only this thread's channels can tell (rank.py)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self.error is None and (left := deadline - time.monotonic()) > 0:
                self._lock.wait(left)
            return self.error

    def _check_alive(self, seen: dict[int, float], now: float, silent_s: float) -> None:
        """A rank that has not said bye and sent nothing, not even a heartbeat, for ``silent_s`` is dead:
        its socket never closed (a killed host, a cut network), so only its silence tells."""
        for rank, t in seen.items():
            if rank not in self._byes and now - t > silent_s:
                raise ChannelError(f"rank {rank} sent nothing, not even a heartbeat, for {now - t:.0f} s: it is dead "
                                   f"or cut off (the heartbeat timeout, DFLASH_HEARTBEAT_S, is {silent_s:g} s)")

    # ------------------------------------------------------------------ messages
    def _handle(self, msgs: list[tuple[int, m.Message]]) -> None:
        t = self.now()
        # puts before takes: every ready report and close of this poll first, in producer order
        for rank, msg in sorted(msgs, key=lambda rm: (not isinstance(rm[1], _PUTS), rm[0])):
            self._on(rank, msg, t)
        if t - self._last_control_poll >= CONTROL_POLL_S:
            self._last_control_poll = t
            self._apply_control(step=None)
        self._dispatch(self.coord.serve(t), t)
        if self.coord.controls:
            self._write_decisions()

    def _on(self, rank: int, msg: m.Message, t: float) -> None:
        """One message from ``rank``, by its class; a message from a rank of the wrong role is an error."""
        producer = rank in self.roles.target_ranks
        match msg:
            case m.NextItem() if producer:
                self._admit_next(rank)
            case m.Ready() if producer:
                self._on_ready(rank, msg, t)
            case m.Closed() if producer:
                self._closed_producers.add(rank)
                self.coord.producer_closed(rank)
            case m.Request(step=step) if not producer:
                self.coord.request(rank - self.roles.n_target, step, t)
            case m.Done() if not producer:
                self._on_done(rank, msg, t)
            case m.Bye():
                self._on_bye(rank, msg, t)
            case m.Beat():
                pass  # alive: its time is noted in _main
            case m.Failed(line=line):  # the cause, unless a rank vanished within the grace (_poll); then every
                if self._failing is None:  # channel closes, so every rank leaves
                    self.hub.retire(rank)  # its own exit is not news
                    self._failing = (time.monotonic() + LOST_PEER_GRACE_S, RankFailed(f"rank {rank} failed: {line}"))
            case _:
                role = "producer" if producer else "drafter"
                raise m.ProtocolError(f"rank {rank} ({role}) sent {type(msg).__name__}, which a {role} never sends")

    def _admit_next(self, rank: int) -> None:
        """The producer may compute its next item; while the job holds between blocks it waits instead."""
        if self._paused:
            self._parked.append(rank)
            return
        nxt = self._next_id()
        if nxt is not None:
            self._computing.add(rank)
        self.hub.send(rank, m.Admit(nxt))

    def _next_id(self) -> str | None:
        if self.coord.stopped:
            return None
        spec = self.feed.next()
        return None if spec is None else spec.item_id

    def _on_ready(self, rank: int, msg: m.Ready, t: float) -> None:
        self._computing.discard(rank)
        spec = self.sampler.item(msg.item_id)
        item = QueueItem(spec.item_id, spec.bucket, spec.n_seqs, spec.real_tokens, spec.padded_len, msg.nbytes,
                         payload=msg.meta)
        self._items[spec.item_id] = _ReadyItem(msg, rank, t - msg.compute_s, t)
        self.telemetry.add(rank, {"target_forward_s": msg.compute_s, **msg.stages}, msg.gpu)
        if self.coord.stopped:
            self.hub.send(rank, m.Stop())
            return
        if self.coord.ready(rank, item, t):
            self._produced(spec.item_id, t, 0.0)
            self._admit_next(rank)

    def _produced(self, item_id: str, t: float, blocked_s: float) -> None:
        info = self._items[item_id]
        spec = self.sampler.item(item_id)
        self.produced += 1
        self.producer_blocked_s += blocked_s
        self.records.write("produce", t=info.t_end, item_id=item_id, worker=info.rank, rank=info.rank,
                           pid=info.ready.pid, host=info.ready.host, device=info.ready.device, **self._place(info.rank),
                           bucket=spec.bucket,
                           n_seqs=spec.n_seqs, real_tokens=spec.real_tokens,
                           padded_len=spec.padded_len, t_start=info.t_start, t_end=info.t_end,
                           blocked_s=blocked_s, bytes=info.ready.nbytes, t_put=t, stages=info.ready.stages)

    def _on_done(self, rank: int, msg: m.Done, t: float) -> None:
        step, d = msg.step, rank - self.roles.n_target
        self._done.setdefault(step, {})[d] = msg
        if len(self._done[step]) == self.roles.n_drafter:
            done = self._done.pop(step)
            if all(x.skipped for x in done.values()):
                self._skip(done)
            else:
                self._commit(step, done, t)

    def _skip(self, done: dict[int, m.Done]) -> None:
        """A step whose takes held no anchor: its items are done (counted ``skipped_no_anchors``), not
        trained; no ledger step, no records. The drafters take for the same step number again."""
        ids = [i for d in sorted(done) for take in done[d].takes for i in take.item_ids]
        self.feed.trained(ids)
        self.skipped += len(ids)
        self.coord.core.counters.trained += len(ids)  # done with, for the queue's accounting
        for d in done:
            self._assigned.pop(d, None)

    def _on_bye(self, rank: int, msg: m.Bye, t: float) -> None:
        """Drafters say bye after their last step (the host rank after its final checkpoint), producers after stop."""
        self._byes[rank] = msg
        self.hub.retire(rank)  # it may exit now; its closed channel is not a failure
        if set(self.roles.drafter_ranks) <= set(self._byes) and not self.coord.stopped:
            self._stop(t, self._byes[self.roles.coordinator_rank])
        if len(self._byes) == self.roles.world_size and self.summary is not None:
            self.records.write("summary", t=t, **self.summary)

    # ------------------------------------------------------------------ decisions -> ranks
    def _dispatch(self, actions: list[Any], t: float) -> None:
        for a in actions:
            if isinstance(a, Admit):
                self._produced(a.item_id, t, a.blocked_s)
                self._admit_next(a.producer)
            elif isinstance(a, Assignment):
                self._assign(a)
            elif isinstance(a, NoWork):
                self.hub.send(self.roles.n_target + a.drafter, m.NoWork(a.step))

    def _assign(self, a: Assignment) -> None:
        drafter_rank = self.roles.n_target + a.drafter
        self._assigned[a.drafter] = a
        self.drafter_wait_s += a.wait_s
        for x in a.transfers:  # the producer's part of each round first: it posts its send at once
            self.hub.send(x.producer, m.Send(x.round, x.item_id, drafter_rank))
        self.hub.send(drafter_rank, m.Assign(a.step, tuple(m.Incoming(x.round, x.item_id, x.producer, x.meta)
                                                           for x in a.transfers)))

    def _commit(self, step: int, done: dict[int, m.Done], t: float) -> None:
        """Every drafter finished ``step``: ledger first, then take records in drafter order, then the step."""
        ids = [i for d in sorted(done) for take in done[d].takes for i in take.item_ids]
        self.ledger.commit(step, ids)
        self.feed.trained(ids)
        self.trained += len(ids)
        self.coord.core.counters.trained += len(ids)
        for d in sorted(done):
            a = self._assigned.pop(d, None)
            for take in done[d].takes:
                if a is None or tuple(i.item_id for i in a.items) != take.item_ids:
                    raise m.ProtocolError(f"rank {self.roles.n_target + d} reported a take of {list(take.item_ids)} "
                                          f"it was not assigned")
                self.mix.add_take(a.bucket, [i.padded_len for i in a.items])
                self.records.write("take", t=a.t, drafter=d, rank=self.roles.n_target + d, pid=done[d].pid,
                                   host=done[d].host, device=done[d].device, **self._place(self.roles.n_target + d),
                                   step=step, item_ids=list(take.item_ids), bucket=a.bucket, wait_s=a.wait_s,
                                   depth_before=a.depth_before, bucket_depths=list(a.bucket_depths), gate=a.gate,
                                   rounds=[x.round for x in a.transfers],
                                   producers=[x.producer for x in a.transfers], **take.record_fields())
        info = done[0].step_info
        if info is None:
            raise m.ProtocolError(f"rank {self.roles.coordinator_rank} (the host drafter) sent Done without step_info")
        per_rank = {str(self.roles.n_target + d): done[d].stages for d in sorted(done)}
        for d in sorted(done):
            self.telemetry.add(self.roles.n_target + d, done[d].stages, done[d].gpu)
        telemetry = None
        if (step + 1) % self.cfg.train.log_every == 0:
            telemetry = self.last_telemetry = self.telemetry.interval()
        self.records.write("step", t=t, step=step, **info, stages=done[0].stages, rank_stages=per_rank,
                           queue=self.coord.state(), telemetry=telemetry)
        self._apply_control(step=step + 1)

    def _stop(self, t: float, host_bye: m.Bye) -> None:
        self.close_t = t
        for _w, b in sorted(self.coord.blocked.items()):  # held at the cap: produced, and discarded below
            self._produced(b.item.item_id, t, t - b.t)
        discarded, actions = self.coord.stop()
        self._dispatch(actions, t)
        self.discarded = [i.item_id for i in discarded]
        for p in self.roles.target_ranks:
            self.hub.send(p, m.Stop())
        c = self.coord.core.counters
        produced = self.produced
        skipped = self.before.get("skipped_no_anchors", 0) + self.skipped
        summary = {"produced": self.before["trained"] + self.before.get("skipped_no_anchors", 0) + produced,
                   "trained": self.before["trained"] + self.trained,
                   "skipped_no_anchors": skipped, "discarded_at_stop": len(self.discarded),
                   "discarded_ids": list(self.discarded),
                   "replayed": self.before.get("replayed", 0) + self.feed.replayed, **(host_bye.summary or {}),
                   "queue_stats": {"takes": c.takes, "max_depth_seen": c.max_depth_seen,
                                   "peak_queued_bytes": c.peak_queued_bytes,
                                   "max_item_age_s": list(c.per_bucket_max_age_s),
                                   "producer_blocked_s": self.producer_blocked_s,
                                   "drafter_wait_s": self.drafter_wait_s},
                   "ranks": {"targets": self.roles.target_ranks, "drafters": self.roles.drafter_ranks},
                   **({"placement": self.placement.as_json()} if self.placement is not None else {}),
                   "queue": dict(self.queue.__dict__)}  # the knobs in force at the end
        self.summary = summary

    def _name_nodes(self) -> None:
        """On several nodes each channel names its rank's node and that node's ranks, so a lost node is named
        by the first error it causes here (``rank 2 (node 1: ranks 2, 3) closed its control channel``)."""
        if self.placement is None or len({p.node for p in self.placement.places}) < 2:
            return
        for rank, ch in self.hub.channels.items():
            node = self.placement.places[rank].node
            peers = ", ".join(str(p.rank) for p in self.placement.places if p.node == node)
            ch.peer = f"rank {rank} (node {node}: ranks {peers})"

    def _place(self, rank: int) -> dict[str, int]:
        """A record's ``node`` and ``local_rank`` of ``rank`` (none for a service without a placement)."""
        if self.placement is None:
            return {}
        place = self.placement.places[rank]
        return {"node": place.node, "local_rank": place.local_rank}

    # ------------------------------------------------------------------ checkpoints
    def snapshot(self, step: int, timeout: float) -> dict[str, Any]:
        """The coordinator's part of the checkpoint after ``step`` (waits for the ledger to commit it)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self.ledger.last_step < step:
                if self.error is not None:
                    raise RuntimeError(f"coordinator failed: {self.error}") from self.error
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ledger step {step} not committed within {timeout} s (a drafter rank hangs)")
                self._lock.wait(0.5)
            self.ledger.sync()
            return {"t": self.now(), "feed": self.feed.state(), "queue_core": self.coord.core.state_dict(),
                    "queue_config": dict(self.queue.__dict__), "control_serial": self.control.serial,
                    "autopilot": None if self.coord.autopilot is None else self.coord.autopilot.state_dict(),
                    "ledger_step": step,
                    "trained": self.before["trained"] + self.trained,
                    "skipped_no_anchors": self.before.get("skipped_no_anchors", 0) + self.skipped,
                    "replayed": self.before.get("replayed", 0) + self.feed.replayed}

    # ------------------------------------------------------------------ holding between blocks
    def pause(self, timeout: float) -> None:
        """Hold: producers get no admit (they finish the item in hand and wait), the queue stays as it is.
        Returns once no producer computes, so the held job takes no CPU from another job's block."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._paused = True
            while self._computing:
                if self.error is not None:
                    raise RuntimeError(f"coordinator failed: {self.error}") from self.error
                if time.monotonic() > deadline:
                    raise TimeoutError(f"producers {sorted(self._computing)} still computing after {timeout} s")
                self._lock.wait(0.1)
            self._pause_t = self.now()  # after the items in hand: the skipped time is idle for everyone

    def unpause(self) -> None:
        """Continue: the clock skips the pause (records read as one run) and parked producers are admitted."""
        with self._lock:
            self._t0 += self.now() - self._pause_t
            self._paused = False
            parked, self._parked = self._parked, []
            for rank in parked:
                self._admit_next(rank)

    def note(self, reason: str, change: dict[str, Any]) -> None:
        """A change the host rank made to the run (e.g. a new learning-rate phase), as a control record."""
        with self._lock:
            self.records.write("control", t=self.now(), accepted=True, step=None, change={"schedule": change},
                               reason=reason)
        self.progress(f"{reason}: {change}")

    # ------------------------------------------------------------------ live re-tuning
    def _write_control_start(self) -> None:
        self.records.write("control", t=self.now(), accepted=True, step=None,
                           change={"start": dict(self.queue.__dict__)},
                           reason="resumed queue config" if self.before["trained"] else "initial queue config")

    def _apply_control(self, step: int | None, at_start: bool = False) -> None:
        """A new control file: validated against the run's own config, recorded either way; never fatal."""
        ctl, problem = self.control.poll()
        if problem is not None:
            self.records.write("control", t=self.now(), accepted=False, change=rejected_change(None), step=step,
                               serial=None, reason=problem)
            self.progress(f"live change rejected: {problem}")
        if ctl is None:
            return
        change = ctl["queue"]
        when = "at resume" if at_start else "between takes"
        try:
            if not isinstance(change, dict) or not change:
                raise ConfigError("control", "must hold a non-empty 'queue' table", change)
            overrides = {f"queue.{k}": v for k, v in change.items()}
            if self.queue.mode == "auto" and "mode" not in change:
                overrides["queue.mode"] = "static"  # a person set the knobs: the run is manual from here
            in_force = dataclasses.replace(self.cfg, queue=self.queue)  # judged against the knobs in force
            cfg = with_overrides(in_force, overrides)
        except (ConfigError, TypeError, ValueError) as exc:
            reason = exc.line() if isinstance(exc, ConfigError) else f"control: {exc}"
            self.records.write("control", t=self.now(), accepted=False, change=rejected_change(change), step=step,
                               serial=ctl["serial"], reason=reason)
            self.progress(f"live change #{ctl['serial']} rejected: {reason}")
            return
        if cfg.queue.mode == "auto" and self.coord.autopilot is None:
            self.coord.autopilot = self._new_autopilot(cfg)
            self.progress("queue autopilot: on (tune-live --queue auto); it starts from the current knobs")
        elif cfg.queue.mode != "auto" and self.coord.autopilot is not None:
            self.coord.autopilot = None
            self.progress("queue autopilot: off, the knobs are manual now (tune-live --queue auto hands them back)")
        self.coord.reconfigure(cfg.queue, self.now())
        self.records.write("control", t=self.now(), accepted=True, change=change, step=step, serial=ctl["serial"],
                           queue=dict(cfg.queue.__dict__), applied=when)
        self.progress(f"live change #{ctl['serial']} applied {when}: {change}")
