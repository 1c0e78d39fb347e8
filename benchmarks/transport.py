"""Data-plane cost per item: the trainer's control + data plane (gloo and shm) against a raw copy and a raw send.

Run: python benchmarks/transport.py [--items N] [--seq 256] [--width 2880] [--blocks 5]
Two real processes, measured side by side in one run (alternating blocks):
  copy      rank 1 copies each item's tensors into a warm buffer of its own (the floor of any plane that
            moves the bytes once: what a shared-memory plane should cost);
  raw       rank 0 sends each item's tensors in one gloo ``batch_isend_irecv``, rank 1 receives them;
  gloo/shm  the trainer's own pieces: rank 1 hosts the coordinator thread (CoordinatorService with the one
            QueueCore), rank 0 runs the Producer loop (ready -> admit, a sender thread doing its rounds), rank 1
            asks for each take, receives it with the plane's Transport in its round, releases it and reports it
            done (ledger commit, take and step records), exactly as a drafter rank does, without its compute.
Prints seconds per item and the ratios to the raw copy and the raw send (goal: shm <= 1.2x the raw copy, for
a CPU-profile item: SmolLM2, 5 captured layers x 576 = 2,880 wide, 256 tokens, fp32).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def item_tensors(seq: int, width: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(1, seq, width), torch.ones(1, seq, dtype=torch.long), torch.ones(1, seq, dtype=torch.long),
            torch.ones(1, seq, dtype=torch.bool))


def raw(rank: int, n: int, tensors: tuple[torch.Tensor, ...]) -> float:
    bufs = [torch.empty_like(t) for t in tensors]
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        ops = [dist.P2POp(dist.isend, t, 1) for t in tensors] if rank == 0 else \
            [dist.P2POp(dist.irecv, b, 0) for b in bufs]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    dist.barrier()
    return (time.perf_counter() - t0) / n


def copy(rank: int, n: int, tensors: tuple[torch.Tensor, ...]) -> float:
    """One in-memory copy of each item's bytes into a warm buffer (rank 1; rank 0 waits)."""
    bufs = [torch.empty_like(t) for t in tensors]
    for b, t in zip(bufs, tensors, strict=True):
        b.copy_(t)
    dist.barrier()
    t0 = time.perf_counter()
    if rank == 1:
        for _ in range(n):
            for b, t in zip(bufs, tensors, strict=True):
                b.copy_(t)
    per_item = (time.perf_counter() - t0) / n
    dist.barrier()
    return per_item


def plane_only(rank: int, n: int, tensors: tuple[torch.Tensor, ...], plane: str) -> float:
    """The plane's Transport alone, rounds back to back: rank 0 posts (waiting two rounds behind, as its
    sender thread does), rank 1 receives and releases."""
    from dflash.pipeline.transport import describe, make_transport

    transport, metas = make_transport(plane, torch.device("cpu")), describe(tensors)
    dist.barrier()
    t0 = time.perf_counter()
    posted = []
    for r in range(1, n + 1):
        if rank == 0:
            posted.append(transport.post_send(tensors, 1, r))
            if len(posted) > 2:
                posted.pop(0).wait()
        else:
            lease, _ = transport.recv(metas, 0, r)
            transport.release(lease)
    for p in posted:
        p.wait()
    per_item = (time.perf_counter() - t0) / n
    dist.barrier()
    return per_item


def pipeline(rank: int, n: int, tensors: tuple[torch.Tensor, ...], out: Path, plane: str) -> float:
    from dflash.core.config import DflashConfig, QueueConfig, WorkloadConfig
    from dflash.core.sampler import Sampler
    from dflash.pipeline import messages as m
    from dflash.pipeline.channel import connect
    from dflash.pipeline.roles import Roles
    from dflash.pipeline.service import CoordinatorService, ResumeState
    from dflash.pipeline.transport import make_transport
    from dflash.pipeline.workers import Producer, Status

    roles = Roles(rank, 2, rank, 2, 1, 1)
    w = WorkloadConfig(max_len=512, bucket_bounds=(512,), seqs_per_item=1)
    cfg = DflashConfig(workload=w, queue=QueueConfig(min_ready=1, max_depth=8))
    sampler = Sampler([200] * (n + 16), w, seed=0)
    box = [None]
    if rank == 1:
        service = CoordinatorService(cfg, roles, sampler, out, "bench", resume=ResumeState(), wait_s=60,
                                     progress=lambda _m: None)
        service.start()
        box = [service.hub.port]
    dist.broadcast_object_list(box, src=1)
    ch = connect("127.0.0.1", box[0], rank, 30)
    transport = make_transport(plane, torch.device("cpu"))
    status = Status(out / f"rank-{rank}.status", rank)
    if rank == 0:
        Producer(ch, transport, lambda spec: tensors, sampler.item, check=False, status=status).run()
        dist.barrier()
        return 0.0
    t0 = time.perf_counter()
    for step in range(n):
        ch.send(m.Request(step))
        reply = ch.recv(60)
        assert isinstance(reply, m.Assign)
        x = reply.transfers[0]
        lease, dt = transport.recv(x.meta.tensors, x.src, x.round)
        transport.release(lease)  # as the drafter does after its backward
        take = m.TakeReport((x.item_id,), 0.0, dt, 0, 0, 1, 0, 0)
        ch.send(m.Done(step, os.getpid(), (take,), {}, {"loss": 0.0, "lr": 0.0, "anchors": 0, "tokens": 0}, [],
                       False))
    per_item = (time.perf_counter() - t0) / n
    ch.send(m.Bye(summary={"steps": n}))
    service.join(60)
    dist.barrier()
    return per_item


PLANES = ("gloo", "shm")


def _rank(rank: int, port: int, n: int, seq: int, width: int, out: str, result: str, blocks: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    tensors = item_tensors(seq, width)
    raw(rank, 5, tensors)  # warm-up of the pair's connection
    times: dict[str, list[float]] = {k: [] for k in ("copy", "raw", *PLANES, *(f"{p}_only" for p in PLANES))}
    for b in range(blocks):  # alternating blocks: load drift on a shared machine hits all alike
        times["copy"].append(copy(rank, n, tensors))
        times["raw"].append(raw(rank, n, tensors))
        for plane in PLANES:
            times[f"{plane}_only"].append(plane_only(rank, n, tensors, plane))
            d = Path(out) / f"block-{b}-{plane}"
            d.mkdir(exist_ok=True)
            times[plane].append(pipeline(rank, n, tensors, d, plane))
    if rank == 1:
        Path(result).write_text(json.dumps(times))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=200)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--width", type=int, default=5 * 576)
    ap.add_argument("--blocks", type=int, default=5, help="alternating raw/pipeline blocks (medians compared)")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = Path(tempfile.mkdtemp())
    result = tmp / "result.txt"
    mp.start_processes(_rank, args=(port, args.items, args.seq, args.width, str(tmp), str(result), args.blocks),
                       nprocs=2, start_method="spawn")
    times = json.loads(result.read_text())
    mb = sum(t.numel() * t.element_size() for t in item_tensors(args.seq, args.width)) / 1e6
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.blocks} x {args.items} items of {mb:.2f} MB ({args.seq} tokens x {args.width} fp32 hidden states "
          f"+ ids/masks), 2 processes; medians of alternating blocks")
    names = {"copy": "raw in-memory copy", "raw": "raw gloo batch_isend_irecv", "gloo_only": "gloo Transport alone",
             "shm_only": "shm Transport alone", "gloo": "trainer control + gloo", "shm": "trainer control + shm"}
    for k, name in names.items():
        print(f"  {name:28s} {med[k] * 1e3:8.3f} ms/item  {med[k] / med['copy']:6.2f}x copy  "
              f"{med[k] / med['raw']:6.2f}x raw send   (blocks {', '.join(f'{x * 1e3:.2f}' for x in times[k])})")
    print(f"  shm / gloo: transport alone {med['shm_only'] / med['gloo_only']:.2f}x, with the trainer's control "
          f"plane {med['shm'] / med['gloo']:.2f}x   (goal: shm transport <= 1.2x the raw copy)")


if __name__ == "__main__":
    main()
