"""Receive buffers are pooled by identity, and every plane returns them through the lease its caller holds.

The first GPU run crashed in the pool: ``list.remove`` compared two free buffers of different sizes
by value, and the host-staged plane registered ``id()`` of a CPU view while handing out device
copies, so ``release`` never found them. Here two real processes push items of several sizes
through each plane (the host plane with the CPU standing in for the device, the NCCL plane's logic
over gloo), the drafter holding two items at once and releasing them out of order, as a drafter
with a take of several items does; every item must arrive intact and the pool must reuse its
buffers. The sharing plane (shm) must also keep each item on its producer until the drafter's ack.
"""

from __future__ import annotations

import datetime
import json
import os
import traceback
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash.pipeline.roles import DATA_GLOO, DATA_HOST, DATA_IPC, DATA_NCCL, DATA_SHM
from dflash.pipeline.transport import POOL_BUFFERS, BufferPool, Lease, describe, make_transport, probe_sharing

PLANES = (DATA_GLOO, DATA_HOST, DATA_NCCL, DATA_SHM)
# On the CPU two of these are stand-ins, named as such in the test ids: the host plane stages through a
# "device" that is the CPU, and NcclTransport is the same class body as GlooTransport run over gloo
# (NCCL itself is verified only by a GPU run: dflash gpu-check with 2+ GPUs).
STAND_INS = {DATA_HOST: "host-plane-with-cpu-as-device", DATA_NCCL: "nccl-class-over-gloo-cpu-stand-in"}
CUDA_PLANES = (DATA_HOST, DATA_IPC)  # two ranks sharing cuda:0 (run where a GPU is)
SIZES = (3, 7, 5, 7, 2, 9, 3, 9, 5, 2)  # tokens per item: several buffer sizes, each size seen again later
ROUNDS = 2 * len(SIZES)  # the second pass meets only sizes the pool has seen
TIMEOUT_S = 60


def payload(r: int, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    n = SIZES[r % len(SIZES)]
    hidden = torch.arange(n * 16, dtype=torch.float32).reshape(1, n, 16) + 1000 * r
    return tuple(t.to(device) for t in (hidden, torch.full((1, n), r, dtype=torch.long),
                                        torch.ones(1, n, dtype=torch.bool)))


def _producer(plane: str, device: str) -> dict:
    """Posts every round at once and waits for them in round order, two behind (as the producer's reader and
    sender threads do), so the drafter can hold two items."""
    transport = make_transport(plane, torch.device(device))
    held_until_ack, posted = True, []
    for r in range(ROUNDS):
        if r == len(SIZES):
            first_pass = pool_of(transport).allocated
        item = payload(r, device)
        alive = weakref.ref(item[0])
        posted.append(transport.post_send(item, 1, r + 1))
        del item
        if r == 0:  # a sharing plane holds only its packed copy: the producer may drop the item (workers.py)
            original_dropped = alive() is None
        if plane in (DATA_SHM, DATA_IPC) and r == 0:  # the drafter has the item but has not released it yet
            dist.barrier()
            held_until_ack = not posted[0].works[1].is_completed() and transport.send_pool.free == 0
            dist.barrier()
        if len(posted) > 2:
            posted.pop(0).wait()
    for pending in posted:
        pending.wait()
    return {"held_until_ack": held_until_ack, "new_in_second_pass": pool_of(transport).allocated - first_pass,
            "original_dropped": original_dropped}


def _drafter(plane: str, device: str) -> dict:
    transport = make_transport(plane, torch.device(device))
    held: list[tuple[int, Lease]] = []
    for r in range(ROUNDS):
        if r == len(SIZES):
            first_pass = pool_of(transport).allocated
        lease, _ = transport.recv(describe(payload(r)), 0, r + 1)
        if plane in (DATA_SHM, DATA_IPC) and r == 0:
            dist.barrier()
            dist.barrier()
        held.append((r, lease))
        if len(held) == 2:  # a take of two items, released newest first
            for k, got in reversed(held):
                for a, b in zip(got.tensors, payload(k, device), strict=True):
                    assert torch.equal(a, b), f"item {k} arrived with another item's content"
                transport.release(got)
                try:
                    transport.release(got)
                    raise AssertionError("a lease was released twice without an error")
                except RuntimeError:
                    pass
            held.clear()
    return {"allocated": transport.pool.allocated, "free": transport.pool.free,
            "new_in_second_pass": transport.pool.allocated - first_pass}


def pool_of(transport: Any) -> BufferPool:
    """The pool a plane allocates its item buffers from: the drafter's receive pool, or a sharing producer's."""
    return getattr(transport, "send_pool", transport.pool)


def _rank(rank: int, port: int, out: str, device: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    results: dict = {"probe": probe_sharing(DATA_SHM if device == "cpu" else DATA_IPC, torch.device(device))}
    for plane in PLANES if device == "cpu" else CUDA_PLANES:
        try:
            results[plane] = (_producer if rank == 0 else _drafter)(plane, device)
        except Exception:
            results[plane] = {"error": traceback.format_exc()}
            break  # the peer may now wait on this rank: the process group timeout ends it
        dist.barrier()
    Path(out, f"rank-{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _run(tmp_path_factory: pytest.TempPathFactory, device: str, planes: tuple[str, ...]) -> dict[str, dict]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path_factory.mktemp("pool")
    mp.start_processes(_rank, args=(port, str(out), device), nprocs=2, start_method="spawn")
    producer, drafter = (json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1))
    merged = {p: {**producer.get(p, {"error": "not reached"}),
                  **{f"drafter_{k}": v for k, v in drafter.get(p, {"error": "not reached"}).items()}} for p in planes}
    return {"probe": [producer["probe"], drafter["probe"]], **merged}


@pytest.fixture(scope="module")
def planes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    return _run(tmp_path_factory, "cpu", PLANES)


@pytest.fixture(scope="module")
def cuda_planes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    if not torch.cuda.is_available():
        pytest.skip("no GPU: the CUDA IPC and device-staged planes run where one is")
    return _run(tmp_path_factory, "cuda:0", CUDA_PLANES)


@pytest.mark.parametrize("plane", PLANES, ids=lambda p: STAND_INS.get(p, p))
def test_items_of_several_sizes_arrive_intact_and_their_buffers_are_reused(planes: dict, plane: str) -> None:
    got = planes[plane]
    assert "error" not in got and "drafter_error" not in got, got.get("error") or got.get("drafter_error")
    assert got["new_in_second_pass"] == 0 and got["drafter_new_in_second_pass"] == 0, got  # buffers reused
    assert got["drafter_free"] <= POOL_BUFFERS
    if plane == DATA_SHM:  # nothing pooled on the drafter: it maps the producer's pooled buffers
        assert got["drafter_allocated"] == 0

@pytest.mark.parametrize("plane", CUDA_PLANES)
def test_on_one_shared_gpu_items_arrive_intact_and_their_buffers_are_reused(cuda_planes: dict, plane: str) -> None:
    got = cuda_planes[plane]
    assert "error" not in got and "drafter_error" not in got, got.get("error") or got.get("drafter_error")
    assert got["new_in_second_pass"] == 0 and got["drafter_new_in_second_pass"] == 0, got
    if plane == DATA_IPC:
        assert got["held_until_ack"] and got["drafter_allocated"] == 0


def test_the_ranks_agree_that_sharing_works_before_they_use_it(planes: dict) -> None:
    assert planes["probe"] == [None, None]  # each rank mapped the other's buffer and read its bytes


def test_a_shared_item_stays_with_its_producer_until_the_drafter_releases_it(planes: dict) -> None:
    got = planes[DATA_SHM]
    assert "error" not in got, got.get("error")
    assert got["held_until_ack"]
    assert got["original_dropped"]  # while it waits for the ack, the producer's original item is already freed


def test_the_pool_finds_buffers_by_identity_smallest_fit_first() -> None:
    pool = BufferPool(torch.device("cpu"), keep=3)
    a, b, c = pool.take(100), pool.take(300), pool._make(200)
    pool.allocated += 1
    for buf in (b, a, c):
        buf.zero_()  # equal content: a pool comparing by value would confuse them
        pool.give(buf)
    assert pool.take(150) is c and pool.take(50) is a and pool.take(250) is b
    assert pool.allocated == 3
    pool.give(a)
    with pytest.raises(RuntimeError, match="twice"):
        pool.give(a)
    for n in (1010, 1020, 1030):  # none fits in a free buffer: three more allocations, the smallest dropped
        pool.give(pool.take(n))
    assert pool.allocated == 6 and pool.free == 3 and all(b.numel() >= 1010 for b in pool._free)


def test_the_pool_keeps_its_largest_buffers() -> None:
    pool = BufferPool(torch.device("cpu"), keep=2)
    bufs = [pool.take(n) for n in (10, 30, 20)]
    assert [b.numel() for b in bufs] == [10, 30, 30]  # a fresh buffer is as large as the largest so far
    for buf in bufs:
        pool.give(buf)
    assert pool.free == 2 and pool.take(25) is bufs[1] and pool.take(15) is bufs[2]
