"""Issue 34's hot path on the CPU: the host-planned loss equals the device path and reads no device value
(a tensor subclass marks the received tensors and everything computed from them, and counts every op that
makes a GPU host wait on one); stage timers read events once complete."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch.utils._pytree import tree_flatten

from dflash.model.hostsync import HostMasks, counting, spans, to_host
from dflash.model.planned_loss import planned_loss
from dflash.pipeline.streams import NullEvent, StageTimer
from dflash.pipeline.transport import CudaIpcTransport
from tests.test_drafter import make, rand_batch

SYNC_OPS = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__", "nonzero", "masked_select", "numpy",
            "unique", "__len__"}


class OnDevice(torch.Tensor):
    """A CPU tensor standing for a device one: ops on it stay OnDevice, and host reads of it are counted."""

    reads: ClassVar[list[str]] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        rest = tree_flatten((args[1:], kwargs))[0]
        if name in SYNC_OPS:
            cls.reads.append(name)
        elif name == "__getitem__" and any(isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in rest):
            cls.reads.append("boolean index")
        elif name == "cpu" or (name == "to" and any(str(a) == "cpu" for a in rest)):
            cls.reads.append("copy to the host")
        elif name == "repeat_interleave" and any(isinstance(a, torch.Tensor) for a in rest):
            cls.reads.append("repeat_interleave by a tensor")
        return super().__torch_function__(func, types, args, kwargs)


def test_spans_round_trip_masks_with_several_runs():
    m = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    assert spans(m) == (((1, 3), (4, 5)), ((0, 6),), ())
    h = HostMasks.of(m.long(), m)
    assert torch.equal(h.loss_mask(), m) and h.lengths.tolist() == [3, 6, 0]


@pytest.mark.slow  # ~2.7 s at load 15 (the tensor subclass makes every op a Python call)
def test_host_planned_loss_equals_the_device_path_and_reads_no_device_value():
    """Same anchors, rows, loss, weight, counts and gradients; the device path reads the device many times
    (so the count can fail), the planned one never; the step's one read is its stats (``to_host``)."""
    target, drafter = make(block_size=4, layers=1, anchors=5)
    ids, am, lm, ctx = rand_batch(target, [14, 9, 12], resp_from=3)
    lm[0, 6:8] = False  # a second response span in one row
    host = HostMasks.of(am, lm)

    def run(planned: bool):
        drafter.zero_grad()
        OnDevice.reads = []
        dev = [t.as_subclass(OnDevice) for t in (ctx, ids, lm, am)]
        gen = torch.Generator().manual_seed(3)
        out = planned_loss(drafter, dev[0], dev[1], host, gen) if planned else drafter.loss(*dev, generator=gen)
        out.loss_sum.backward()
        return out, [p.grad.clone() for p in drafter.trainable_parameters()], list(OnDevice.reads)

    ref, g_ref, ref_reads = run(False)
    got, g_got, got_reads = run(True)
    assert len(ref_reads) >= 5 and got_reads == [], (ref_reads, got_reads)
    assert (got.tokens, got.anchors, got.context_seen) == (ref.tokens, ref.anchors, ref.context_seen)
    assert got.tokens > 0 and got.weight_sum == ref.weight_sum
    torch.testing.assert_close(got.loss_sum.as_subclass(torch.Tensor), ref.loss_sum.as_subclass(torch.Tensor),
                               rtol=0, atol=0)
    for a, b in zip(g_ref, g_got, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with counting() as n:  # the step folds loss and hits into one read
        to_host(torch.stack([got.loss_sum.detach(), got.correct.double()]), "stats")
    assert n.n == 1 and n.where == ("stats",) and OnDevice.reads == ["tolist"]


class LateEvent(NullEvent):
    """An event that can be told its device work has not run yet (what a GPU event is before the sync)."""

    __slots__ = ("done",)
    made: ClassVar[list[LateEvent]] = []

    def __init__(self) -> None:
        super().__init__()
        self.done = True
        LateEvent.made.append(self)

    def query(self) -> bool:
        return self.done and super().query()


def test_stage_timer_reads_finished_stages_in_order_and_the_rest_a_step_later(monkeypatch):
    import dflash.pipeline.streams as streams

    monkeypatch.setattr(streams, "new_event", lambda device: LateEvent())
    timer, first, second = StageTimer(torch.device("cpu")), {}, {}
    with timer.stage("forward_s"):
        pass
    timer.add("transfer_s", 0.25)
    with timer.stage("optimizer_s"):
        pass
    late = LateEvent.made[-1]
    late.done = False  # the optimizer's end has not run at this step's read
    with timer.stage("next_s"):
        pass
    timer.collect(first)
    assert list(first) == ["forward_s", "transfer_s"] and first["transfer_s"] == 0.25 and timer.pending == 2
    late.done = True
    timer.collect(second)
    assert list(second) == ["optimizer_s", "next_s"] and timer.pending == 0


class CpuIpc(CudaIpcTransport):
    """CUDA IPC's bookkeeping with its two CUDA calls done on host memory: a handle names the buffer, and
    mapping it finds that buffer (what a second process's mapping would show)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.by_name: dict[int, torch.Tensor] = {}
        self.reduces = 0

    def _shareable(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8)

    def _reduce(self, buf: torch.Tensor) -> tuple:
        self.reduces += 1
        self.by_name[self.reduces] = buf
        return (None,) * 7 + (self.reduces, buf.numel(), 0)

    def _rebuild(self, args: tuple) -> torch.Tensor:
        return self.by_name[args[7]]


def test_cuda_ipc_shares_each_pooled_buffer_once_and_its_bookkeeping_stays_flat_over_10000_items():
    """Producer and drafter halves of the IPC plane (no CUDA, no process group): items of a few sizes, three in
    flight; each buffer is shared once and mapped once, and nothing grows from item 1,000 to item 10,000."""
    import random
    from collections import deque

    from dflash.pipeline.transport import MAPPED_PER_PEER, POOL_BUFFERS, decode_handle, encode_handle

    producer, drafter = CpuIpc(), CpuIpc()
    drafter.by_name = producer.by_name  # the handle names memory both processes see
    rng = random.Random(0)
    in_flight: deque = deque()
    sizes = (1024, 3072, 2048, 4096)

    def books() -> tuple:
        return (producer.shares, len(producer._shared), producer.send_pool.allocated, drafter.maps,
                len(drafter._mapped[0]))

    for i in range(10_000):
        n = rng.choice(sizes)
        buf = producer.send_pool.take(n)
        key, args = decode_handle(encode_handle(producer._handle(buf))) if i % 50 == 0 else producer._handle(buf)
        flat = drafter._open(0, key, args, n)
        assert flat is buf  # the drafter reads the very buffer the producer packed
        in_flight.append(buf)
        if len(in_flight) > 3:  # the drafter's ack: the buffer goes back to the pool
            producer.send_pool.give(in_flight.popleft())
        if i == 999:
            at_1000 = books()
    assert books() == at_1000, (at_1000, books())
    shares, shared, allocated, maps, mapped = books()
    assert shares == allocated == producer.reduces <= POOL_BUFFERS + 4  # one share per buffer, not per item
    assert shared <= POOL_BUFFERS + 4 and maps <= allocated and mapped <= MAPPED_PER_PEER


def test_host_staging_is_pinned_only_with_cuda_and_returns_a_buffer_once_its_copy_has_run():
    from dflash.pipeline.transport import HostStagedTransport

    t = HostStagedTransport(torch.device("cpu"))
    assert t.pinned is False  # no CUDA: pageable, plain copies
    bufs = [t.staging.take(64) for _ in range(3)]
    events = [LateEvent() for _ in range(3)]
    for e in events:
        e.record()
    events[1].done = False  # the second item's copy to the device has not run yet
    t._cooling = list(zip(bufs, events, strict=True))
    t._reclaim()
    assert t.staging.free == 1 and t.cooling == 2 and t.staging._free[0] is bufs[0]  # in order: the third waits
    events[1].done = True
    t._reclaim()
    assert t.staging.free == 3 and t.cooling == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch's own sync detector")
def test_on_cuda_the_planned_loss_and_backward_never_synchronise():
    """Where CUDA is present, torch itself checks: any host sync inside raises (set_sync_debug_mode)."""
    target, drafter = make(block_size=4, layers=1, anchors=5, dtype=torch.float32)
    ids, am, lm, ctx = rand_batch(target, [14, 9, 12], resp_from=3)
    host = HostMasks.of(am, lm)
    drafter.to("cuda")
    drafter.lm_head.to("cuda")
    drafter.embed_tokens.to("cuda")
    ctx, ids = ctx.cuda(), ids.cuda()
    planned_loss(drafter, ctx, ids, host, torch.Generator().manual_seed(3)).loss_sum.backward()  # first-call caches
    drafter.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = planned_loss(drafter, ctx, ids, host, torch.Generator().manual_seed(3))
        out.loss_sum.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with counting() as n:
        loss = to_host(out.loss_sum.detach().reshape(1))
    assert n.n == 1 and loss[0] > 0
