"""Data-plane cost per item: the trainer's control + data plane against a raw torch.distributed send of the same bytes.

Run: python benchmarks/transport.py [--items N] [--seq 256] [--width 2880] [--blocks 5]
Two real processes over gloo (the CPU backend), measured side by side in one run:
  raw       rank 0 sends each item's tensors in one ``batch_isend_irecv``, rank 1 receives them (the floor);
  pipeline  the trainer's own pieces: rank 1 hosts the coordinator thread (CoordinatorService with the one
            QueueCore), rank 0 runs the Producer loop (ready -> admit, a sender thread doing its rounds), rank 1
            asks for each take, receives it with the Transport in its round and reports it done (ledger
            commit, take and step records), exactly as a drafter rank does, without the drafter's compute.
Prints seconds per item for both and the ratio (goal <= 1.2x for a CPU-profile item: SmolLM2, 5 captured
layers x 576 = 2,880 wide, 256 tokens, fp32).
"""

from __future__ import annotations

import argparse
import datetime
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


def pipeline(rank: int, n: int, tensors: tuple[torch.Tensor, ...], out: Path) -> float:
    from dflash.core.config import DflashConfig, QueueConfig, WorkloadConfig
    from dflash.core.sampler import Sampler
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
    transport = make_transport("gloo", torch.device("cpu"))
    status = Status(out / f"rank-{rank}.status", rank)
    if rank == 0:
        Producer(ch, transport, lambda spec: tensors, sampler.item, check=False, status=status).run()
        dist.barrier()
        return 0.0
    t0 = time.perf_counter()
    for step in range(n):
        ch.send({"op": "request", "step": step})
        reply = ch.recv(60)
        x = reply["transfers"][0]
        lease, dt = transport.recv(x["meta"]["tensors"], x["src"], x["round"])
        transport.release(lease)  # as the drafter does after its backward
        take = {"item_ids": [x["item_id"]], "compute_s": 0.0, "transfer_s": dt, "bytes": 0, "tokens": 0,
                "n_seqs": 1, "anchors": 0, "counted_tokens": 0}
        ch.send({"op": "done", "step": step, "pid": os.getpid(), "takes": [take], "stages": {},
                 "step_info": {"loss": 0.0, "lr": 0.0, "anchors": 0, "tokens": 0}})
    per_item = (time.perf_counter() - t0) / n
    ch.send({"op": "bye", "summary": {"steps": n}})
    service.join(60)
    dist.barrier()
    return per_item


def _rank(rank: int, port: int, n: int, seq: int, width: int, out: str, result: str, blocks: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    tensors = item_tensors(seq, width)
    raw(rank, 5, tensors)  # warm-up of the pair's connection
    raws, pipes = [], []
    for b in range(blocks):  # alternating blocks: load drift on a shared machine hits both alike
        raws.append(raw(rank, n, tensors))
        d = Path(out) / f"block-{b}"
        d.mkdir(exist_ok=True)
        pipes.append(pipeline(rank, n, tensors, d))
    raws.append(raw(rank, n, tensors))
    if rank == 1:
        Path(result).write_text(" ".join(map(str, raws)) + "\n" + " ".join(map(str, pipes)))
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
    raws, pipes = ([float(x) for x in line.split()] for line in result.read_text().splitlines())
    mb = item_tensors(args.seq, args.width)[0].numel() * 4 / 1e6
    base, p = statistics.median(raws), statistics.median(pipes)
    print(f"{args.blocks} x {args.items} items of {mb:.2f} MB hidden states ({args.seq} tokens x {args.width}), "
          f"gloo, 2 processes; medians of alternating blocks")
    print(f"  raw batch_isend_irecv  {base * 1e3:8.3f} ms/item   (blocks {', '.join(f'{x * 1e3:.2f}' for x in raws)})")
    print(f"  trainer data plane   {p * 1e3:8.3f} ms/item   (blocks {', '.join(f'{x * 1e3:.2f}' for x in pipes)})")
    print(f"  ratio                {p / base:8.3f}x   (goal <= 1.2x)")


if __name__ == "__main__":
    main()
