"""The two worker loops of a rank: a target rank produces items, a drafter rank trains on its takes.

**Producer** (target rank): ask the coordinator for an item id, form the item from its id, run the
frozen target to the captured layers, keep the tensors in its own memory, report the item *ready*
(shapes, bytes, a content fingerprint) and wait to be admitted (it blocks here while the queue is at
its cap); repeat. A reader thread routes the coordinator's messages; a sender thread runs this rank's
part of each transfer round, in increasing round order, as soon as the coordinator assigns the item.

**Drafter** (drafter rank): every optimizer step the drafter ranks agree whether to stop (one small
all-reduce), each asks for its take of the step, receives the item's tensors in its rounds, runs the
drafter's forward and backward on its unnormalised loss sum, and the ranks all-reduce the gradient
sums and the weight (valid positions) sums; every gradient is divided by the global weight, so two
ranks give the update of one process on the union of their batches. A rank with nothing to train
contributes zero gradients (a zero-weight backward); the optimizer step is skipped only when the
global weight is 0, and the loop ends when no rank got an item (drained).
"""

from __future__ import annotations

import hashlib
import math
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dflash.core.sampler import ItemSpec
from dflash.model.flops import StepCounts, train_flops
from dflash.model.hostsync import HostMasks, note_sync, to_device, to_host
from dflash.model.planned_loss import planned_loss
from dflash.pipeline.abort import FAILURE, handed_off
from dflash.pipeline.channel import Channel, ChannelError
from dflash.pipeline.faults import fault
from dflash.pipeline.messages import (
    Admit,
    Assign,
    Bye,
    Closed,
    Incoming,
    ItemMeta,
    NextItem,
    NoWork,
    ProtocolError,
    Ready,
    Request,
    Send,
    Stop,
    TakeReport,
)
from dflash.pipeline.stageclock import StageClock
from dflash.pipeline.streams import StageTimer, Streams
from dflash.pipeline.transport import Transport, describe, fingerprint

# Stop reasons agreed by the drafter ranks (all-reduce MAX: the highest code wins).
STOP_NONE, STOP_MAX_STEPS, STOP_MAX_MINUTES, STOP_SIGNAL = 0, 1, 2, 3
STOP_NAMES = {STOP_MAX_STEPS: "max_steps", STOP_MAX_MINUTES: "max_minutes", STOP_SIGNAL: "signal"}


def item_generator(seed: int, item_id: str) -> torch.Generator:
    """The anchor sampler of one item: a function of (seed, item id), whichever rank trains it."""
    digest = hashlib.sha1(f"{seed}/{item_id}".encode()).hexdigest()
    return torch.Generator().manual_seed(int(digest[:15], 16))


def capture_item(data: Any, target: Any, capture: Any, spec: ItemSpec, device: torch.device,
                 state_dtype: torch.dtype, clock: StageClock | None = None) -> tuple[torch.Tensor, ...]:
    """Tokenise, pad and capture one item: (hidden, input_ids, attention_mask, loss_mask) on ``device``.

    With ``clock``: ``tokenize_s`` (encode, pad, to the device), ``target_forward_s`` (the target to the
    deepest captured layer) and ``capture_s`` (the captured states cast to the state dtype), each timed
    with the device synchronised.
    """
    from dflash.model.target import collate

    clock = clock or StageClock(torch.device("cpu"))
    with clock.stage("tokenize_s"):
        batch = [data.encode(i) for i in spec.seq_indices]
        pad = target.tokenizer.pad_token_id
        input_ids, attention_mask, loss_mask = collate(batch, pad if pad is not None else 0)
        input_ids, attention_mask, loss_mask = (t.to(device) for t in (input_ids, attention_mask, loss_mask))
    with clock.stage("target_forward_s"):
        states = capture(input_ids, attention_mask)
    with clock.stage("capture_s"):
        hidden = states.to(state_dtype)
    return hidden, input_ids, attention_mask, loss_mask


class Status:
    """What a rank is doing, in a small file per rank, so a hung job names its ranks and where they wait.

    Saying costs an attribute store (it happens several times per item, on the critical path); a daemon
    thread writes the file when the text changed, a few times a second, and ``flush`` writes at once.
    """

    INTERVAL_S = 0.2

    def __init__(self, path: Any, rank: int) -> None:
        self.path, self.rank = path, rank
        self._what = "starting"
        self._written: str | None = None
        self._thread = threading.Thread(target=self._loop, name="rank-status", daemon=True)
        self._thread.start()

    def __call__(self, what: str) -> None:
        self._what = what

    def flush(self) -> None:
        what = self._what
        if what == self._written:
            return
        try:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(f"rank {self.rank} (pid {os.getpid()}): {what}\n")
            os.replace(tmp, self.path)
            self._written = what
        except OSError:
            pass

    def _loop(self) -> None:
        with handed_off("the status thread"):  # its failure is the rank's (dflash.pipeline.abort)
            while True:
                if self._what != self._written:
                    fault("status.write")  # counted per write, so a pass number follows the rank's progress
                self.flush()
                time.sleep(self.INTERVAL_S)


def _use_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)


# ====================================================================== producer
class Producer:
    """A target rank's loop; ``make(spec)`` computes an item's tensors."""

    def __init__(self, channel: Channel, transport: Transport, make: Callable[[ItemSpec], tuple[torch.Tensor, ...]],
                 item_spec: Callable[[str], ItemSpec], *, check: bool, status: Status,
                 gpu: Callable[[], list[dict[str, Any]]] = list, clock: StageClock | None = None) -> None:
        self.ch, self.transport, self.make, self.item_spec, self.gpu = channel, transport, make, item_spec, gpu
        self.clock = clock or StageClock(transport.device)  # ``make`` times its stages on it (capture_item)
        self.check, self.status = check, status
        self.held: dict[str, tuple[torch.Tensor, ...]] = {}
        self.ready: dict[str, Any] = {}  # item id -> the event after its forward (its sends wait on it)
        self.streams = Streams(transport.device)  # forward on one stream, sends on another (null on the CPU)
        self._lock = threading.Lock()
        self._replies: queue.Queue[Admit | Stop | BaseException] = queue.Queue()
        self._sends: queue.Queue[tuple[Any, int] | None] = queue.Queue()  # (posted send, its bytes)
        self.send_s = 0.0
        self.sent_bytes = 0
        self.errors: list[BaseException] = []

    def run(self) -> None:
        reader = threading.Thread(target=self._read, name="producer-reader", daemon=True)
        sender = threading.Thread(target=self._send_loop, name="producer-sender", daemon=True)
        reader.start()
        sender.start()
        self.ch.send(NextItem())
        reply = self._reply()
        while isinstance(reply, Admit) and reply.next is not None:
            reply = self._produce(self.item_spec(reply.next))
        if isinstance(reply, Admit):  # the feed is exhausted: close, then wait for the end of the run
            self.ch.send(Closed())
            self.status("closed; waiting for the end of the run")
            reply = self._reply()
        self._sends.put(None)
        sender.join()
        if self.errors:
            raise self.errors[0]
        self.ch.send(Bye(send_s=self.send_s, sent_bytes=self.sent_bytes))

    def _produce(self, spec: ItemSpec) -> Admit | Stop:
        self.status(f"computing item {spec.item_id}")
        self.clock.stages.clear()
        t0 = time.perf_counter()
        fault("producer.make")
        with self.streams.on(self.streams.compute):
            tensors = self.make(spec)
            ready = self.streams.mark()
        ready.synchronize()  # the item's forward is in its compute time (not the sends in flight on the send stream)
        compute = time.perf_counter() - t0
        with self._lock:
            self.held[spec.item_id] = tensors
            self.ready[spec.item_id] = ready
        meta = ItemMeta(describe(tensors), fingerprint(tensors) if self.check else None,
                        HostMasks.of(tensors[2], tensors[3]) if len(tensors) == 4 else None)
        nbytes = int(tensors[0].numel() * tensors[0].element_size())
        self.ch.send(Ready(spec.item_id, nbytes, meta, compute, dict(self.clock.stages), os.getpid(), self.gpu(),
                           socket.gethostname(), str(self.transport.device)))
        self.status(f"item {spec.item_id} ready; waiting to be admitted")
        return self._reply()

    def _reply(self) -> Admit | Stop:
        got = self._replies.get()
        if isinstance(got, BaseException):
            raise got
        return got

    def _read(self) -> None:
        _use_device(self.transport.device)  # CUDA's current device is per thread (NCCL sends from here)
        try:
            while True:
                match self.ch.recv(None):
                    case Send(round=rnd, item_id=item_id, dst=dst):  # post this rank's part of the round at once
                        with self._lock:
                            tensors = self.held.pop(item_id)
                            ready = self.ready.pop(item_id)
                        nbytes = sum(t.numel() * t.element_size() for t in tensors)
                        fault("producer.post_send")
                        with self.streams.on(self.streams.send):  # behind this item's forward, not the next one's
                            self.streams.wait(self.streams.send, ready)
                            self.streams.keep(tensors, self.streams.send)
                            pending = self.transport.post_send(tensors, dst, rnd)
                        del tensors  # the send keeps what it still reads (on a sharing plane only the packed copy)
                        self._sends.put((pending, nbytes))
                        self.status(f"sending item {item_id} to rank {dst} in round {rnd}")
                    case Admit() as admit:
                        self._replies.put(admit)
                    case Stop() as stop:
                        self._replies.put(stop)
                        return
                    case other:
                        raise ProtocolError(f"a producer got {type(other).__name__} from {self.ch.peer}")
        except (ChannelError, OSError) as exc:
            lost = ChannelError(f"lost the coordinator: {exc}")
            self._replies.put(lost)
            self._sends.put(None)
            FAILURE.fail(lost, "the producer's reader")  # the watchdog, should the owner be blocked elsewhere
        except BaseException as exc:  # anything else (CUDA OOM taking a pool buffer, NCCL, IPC): the owner raises it
            self._replies.put(exc)
            self._sends.put(None)
            FAILURE.fail(exc, "the producer's reader")

    def _send_loop(self) -> None:
        """Waits for this rank's posted sends, in increasing round order (the order the coordinator assigned)."""
        _use_device(self.transport.device)
        try:
            while (got := self._sends.get()) is not None:
                pending, nbytes = got
                fault("producer.send_wait")
                with self.streams.on(self.streams.send):  # a NCCL wait holds the send stream, never the forward's
                    self.send_s += pending.wait()
                self.sent_bytes += nbytes
        except BaseException as exc:  # surfaced by run()
            self.errors.append(exc)
            self._replies.put(exc)
            FAILURE.fail(exc, "the producer's sender")


# ====================================================================== drafter
@dataclass
class StepResult:
    takes: list[TakeReport] = field(default_factory=list)
    loss_sum: torch.Tensor | float = 0.0  # a device tensor while the step runs (read once, with the stats)
    weight_sum: float = 0.0  # sum of the slot weights of the counted positions: the loss's denominator
    tokens: int = 0
    anchors: int = 0
    n_items: int = 0
    real_tokens: int = 0
    model_flops: float = 0.0  # the items' model FLOPs, forward and backward (dflash.model.flops)
    stages: dict[str, float] = field(default_factory=dict)


class DrafterWorker:
    """A drafter rank's loop (the host rank also checkpoints through ``on_step``).

    One host sync per step (issue 34): the host plans each item from the masks in its metadata
    (:mod:`dflash.model.planned_loss`), the loss and the gradient norm stay on the device, and the step
    reads them once, with the counts, after the stats all-reduce (:meth:`_reduce_stats`). Stage times
    come from events read once complete (:class:`~dflash.pipeline.streams.StageTimer`): on a GPU the
    optimizer's is read a step later.
    """

    def __init__(self, channel: Channel, transport: Transport, drafter: Any, optimizer: Any, scheduler: Any, *,
                 group: Any, reduce_device: torch.device, device: torch.device, seed: int, grad_clip: float,
                 autocast: bool, wait_s: float, check: bool, status: Status,
                 verify_ids: Callable[[str, tuple[torch.Tensor, ...]], None] | None = None) -> None:
        self.ch, self.transport, self.drafter = channel, transport, drafter
        self.optimizer, self.scheduler = optimizer, scheduler
        self.group, self.reduce_device, self.device = group, reduce_device, device
        self.seed, self.grad_clip, self.autocast, self.wait_s = seed, grad_clip, autocast, wait_s
        self.check, self.status, self.verify_ids = check, status, verify_ids
        self.params = list(drafter.trainable_parameters())
        self.timer = StageTimer(device)

    def agree_stop(self, local_code: int, elapsed_s: float) -> tuple[int, float]:
        """The ranks' stop decision and the training time (the host's clock: the others pass 0)."""
        if dist.get_world_size(self.group) == 1:
            return local_code, elapsed_s  # nothing to agree on, and no device read
        flag = torch.tensor([local_code, elapsed_s], dtype=torch.float64, device=self.reduce_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        code, elapsed = to_host(flag, "agree_stop") if flag.device.type != "cpu" else flag.tolist()
        return int(code), float(elapsed)

    def step(self, step: int) -> tuple[StepResult, dict[str, Any]] | None:
        """One synchronised optimizer step; None when no drafter rank got an item (drained)."""
        res = StepResult()
        self.timer.collect(res.stages)  # the previous step's stages that had not finished at its sync
        t0 = time.perf_counter()
        fault("drafter.step")
        self.status(f"step {step}: waiting for a take")
        self.ch.send(Request(step))
        reply = self._answer(step)
        res.stages["gate_wait_s"] = time.perf_counter() - t0
        take, leases = None, []
        if isinstance(reply, Assign):
            take, leases = self._train_take(step, reply.transfers, res)
        with self._peer_stage():  # the ranks meet: the slowest one's backward ends it
            grads = sum_gradients(self.params, self.group, self.reduce_device)
            norm = grad_norm_of(grads)
            if dist.get_world_size(self.group) > 1 and dist.get_rank(self.group) != 0:
                norm = torch.zeros_like(norm)  # every rank holds the same summed gradients: count the norm once
            vals = self._reduce_stats(res.loss_sum, norm, [res.weight_sum, res.tokens, res.anchors, res.n_items,
                                                           res.real_tokens, res.model_flops])
        for lease in leases:  # the sync above saw the backward finish: the buffers may take the next items
            fault("drafter.release")
            self.transport.release(lease, settled=True)
        loss_sum, raw_norm, weight_sum, tokens, anchors, n_items, real_tokens, model_flops = vals
        if n_items == 0:
            return None
        with self.timer.stage("optimizer_s"):
            grad_norm, lr = self._apply_gradients(weight_sum, grads, raw_norm)
        self.timer.collect(res.stages)
        if take is not None:
            take["compute_s"] = res.stages.get("drafter_forward_s", 0.0) + res.stages.get("drafter_backward_s", 0.0)
            res.stages["drafter_compute_s"] = take["compute_s"]  # forward + backward (the take record's compute_s)
            res.takes.append(TakeReport(**{**take, "item_ids": tuple(take["item_ids"])}))
        res.loss_sum = loss_sum
        info = {"loss": loss_sum / weight_sum if weight_sum > 0 else math.nan, "lr": lr, "anchors": int(anchors),
                "tokens": int(real_tokens), "counted_tokens": int(tokens), "grad_norm": grad_norm,
                "items": int(n_items), "model_flops": model_flops, "skipped": weight_sum <= 0}
        return res, info

    def _peer_stage(self) -> Any:
        """``wait_peers_s``: device events where the ranks reduce on the device, the host clock where they
        reduce through host memory (gloo)."""
        if self.reduce_device.type == self.device.type == "cuda":
            return self.timer.stage("wait_peers_s")
        return self.timer.host_stage("wait_peers_s")

    def _reduce_stats(self, loss_sum: torch.Tensor | float, norm: torch.Tensor, host: list[float]) -> list[float]:
        """The step's sums over the drafter ranks, read by the host: the step's one host sync."""
        dev = norm.device
        loss = loss_sum.detach().reshape(()) if isinstance(loss_sum, torch.Tensor) else torch.zeros((), device=dev)
        stats = torch.cat([torch.stack([loss.to(dev, torch.float64), norm.to(torch.float64)]),
                           to_device(torch.tensor(host, dtype=torch.float64), dev)])
        if stats.device == self.reduce_device:
            dist.all_reduce(stats, group=self.group)
            return to_host(stats, "step stats")
        note_sync("step stats")  # the copy to host memory is the sync; the all-reduce then runs on the host
        wire = stats.to(self.reduce_device)
        dist.all_reduce(wire, group=self.group)
        return wire.tolist()

    def _answer(self, step: int) -> Assign | NoWork:
        reply = self.ch.recv(self.wait_s)
        if not isinstance(reply, Assign | NoWork) or reply.step != step:
            raise ProtocolError(f"a drafter asked for its take of step {step} and {self.ch.peer} answered {reply!r}")
        return reply

    def _train_take(self, step: int, transfers: tuple[Incoming, ...], res: StepResult
                    ) -> tuple[dict[str, Any], list[Any]]:
        """Receive and train this rank's items; returns the take's fields so far and the leases to release once
        the step's sync has seen the backward finish (an ack before that would need a sync per item)."""
        take: dict[str, Any] = {"item_ids": [], "compute_s": 0.0, "transfer_s": 0.0, "bytes": 0, "tokens": 0,
                                "n_seqs": 0, "anchors": 0, "counted_tokens": 0}
        leases = []
        for x in transfers:  # this rank's part of each round, in increasing round order
            self.status(f"step {step}: receiving item {x.item_id} from rank {x.src} in round {x.round}")
            lease, seconds = self.transport.recv(x.meta.tensors, x.src, x.round)
            self.timer.add("transfer_s", seconds)  # the receive's own host seconds: the bytes, not a forward
            take["transfer_s"] += seconds
            leases.append(lease)
            tensors = lease.tensors
            self._check(x, tensors)
            take["bytes"] += sum(t.numel() * t.element_size() for t in tensors)
            hidden, input_ids, attention_mask, loss_mask = tensors
            host = x.meta.host
            with self.timer.stage("drafter_forward_s"), \
                    torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                gen = item_generator(self.seed, x.item_id)
                out = (planned_loss(self.drafter, hidden, input_ids, host, gen) if host is not None
                       else self.drafter.loss(hidden, input_ids, loss_mask, attention_mask, generator=gen))
            with self.timer.stage("drafter_backward_s"):
                out.loss_sum.backward()  # unnormalised: divided by the global weight after the all-reduce
            real = int(host.lengths.sum()) if host is not None else int(attention_mask.sum())
            res.model_flops += train_flops(self.drafter.spec,
                                           StepCounts(real, out.anchors, out.context_seen, out.tokens))
            take["item_ids"].append(x.item_id)
            take["tokens"] += real
            take["n_seqs"] += int(input_ids.shape[0])
            take["anchors"] += int(out.anchors)
            take["counted_tokens"] += int(out.tokens)
            res.loss_sum = res.loss_sum + out.loss_sum.detach().to(torch.float64)
            res.weight_sum += float(out.weight_sum)
            res.tokens += int(out.tokens)
            res.anchors += int(out.anchors)
            res.n_items += 1
            res.real_tokens += real
            del out, hidden, input_ids, attention_mask, loss_mask, tensors
        return take, leases

    def _check(self, x: Incoming, tensors: tuple[torch.Tensor, ...]) -> None:
        """A received item must be the item assigned: its fingerprint, and its tokens formed from its id."""
        if not self.check:
            return
        note_sync("check_transfers")  # the fingerprint reads the item back to the host (a debugging option)
        want = x.meta.fingerprint
        if want is not None and fingerprint(tensors) != want:
            raise RuntimeError(f"item {x.item_id} from rank {x.src} (round {x.round}) arrived with other "
                               f"content than was sent")
        if self.verify_ids is not None:
            self.verify_ids(x.item_id, tensors)

    def _apply_gradients(self, weight: float, grads: list[torch.Tensor] | None = None,
                         raw_norm: float | None = None) -> tuple[float, float]:
        """Divide the summed gradients by the global weight, clip, step (skipped at weight 0).

        ``grads``: the gradients already summed over the drafter ranks (:func:`sum_gradients`; one rank:
        nothing to sum, divided in place, no flatten, no copy); None sums them here. ``raw_norm``: their
        norm before the division, read with the step's stats, so the clipped norm is ``raw_norm / weight``
        and clipping needs no second read of the device (``clip_grad_norm_``'s rule: scale by
        ``clip / (norm + 1e-6)`` when that is < 1); None computes it here (one more read).
        """
        if grads is None:
            grads = sum_gradients(self.params, self.group, self.reduce_device)
        lr = self.scheduler.get_last_lr()[0]
        if weight <= 0:
            self.optimizer.zero_grad(set_to_none=True)
            return math.nan, lr
        if raw_norm is None:
            raw_norm = to_host(grad_norm_of(grads), "grad norm")
        torch._foreach_div_(grads, weight)
        grad_norm = float(raw_norm) / weight
        coef = self.grad_clip / (grad_norm + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, lr


def sum_gradients(params: list[torch.Tensor], group: Any, reduce_device: torch.device) -> list[torch.Tensor]:
    """Every parameter's gradient (zeros where the backward left none), summed over ``group`` in place
    (:func:`all_reduce_grads` when it has several ranks)."""
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    if dist.get_world_size(group) > 1:
        all_reduce_grads(grads, group, reduce_device)
    return grads


def grad_norm_of(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all ``grads`` together, a 0-d tensor on their device (no host read)."""
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([n.double() for n in torch._foreach_norm(grads)]))


BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket: one all-reduce per ~25 MB of gradients


def grad_buckets(grads: list[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> list[list[torch.Tensor]]:
    """Consecutive gradients grouped into buckets of about ``bucket_bytes`` (one dtype and device each)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        n = g.numel() * g.element_size()
        last = buckets[-1] if buckets else None
        if last is None or size + n > bucket_bytes or (last[0].dtype, last[0].device) != (g.dtype, g.device):
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += n
    return buckets


def all_reduce_grads(grads: list[torch.Tensor], group: Any, reduce_device: torch.device,
                     bucket_bytes: int = BUCKET_BYTES) -> None:
    """Sum ``grads`` over ``group`` in place, bucket by bucket as DDP does (one flat all-reduce per bucket).

    The bucket is flattened where it lives and moved to ``reduce_device`` only when that differs (the
    shared-GPU and CPU drafters reduce over gloo through host memory); elementwise sums, so the result
    equals one all-reduce of everything.
    """
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    for bucket in grad_buckets(grads, bucket_bytes):
        flat = _flatten_dense_tensors(bucket)
        wire = flat.to(reduce_device)
        dist.all_reduce(wire, group=group)
        if wire is not flat:
            flat.copy_(wire)
        for g, summed in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            g.copy_(summed)
