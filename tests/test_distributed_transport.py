"""The data plane alone: random crossed producer -> drafter schedules finish, and every tensor is its round's.

Four real processes over gloo (no model): ranks 0-1 produce, ranks 2-3 receive. A random schedule assigns
each global round to a (producer, drafter) pair, so pairs cross (0->3 while 1->2, then 1->3 ...). Each rank
runs its part of the rounds in increasing order with the trainer's own :class:`Transport`; a tensor's
content is derived from its round, so a swapped transfer fails. A rank that hangs fails the test by name.
"""

from __future__ import annotations

import datetime
import itertools
import os
import random
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash.pipeline.transport import describe, make_transport

WORLD = 4
PRODUCERS = (0, 1)
TIMEOUT_S = 60


SEEDS = (0, 1, 2)


def schedule(seeds: tuple[int, ...] = SEEDS, rounds: int = 40) -> list[tuple[int, int, int]]:
    """Random (round, producer, drafter) triples, one block of ``rounds`` per seed, rounds numbered globally."""
    out = []
    for seed in seeds:
        rng = random.Random(seed)
        out += [(len(out) + 1, rng.choice(PRODUCERS), rng.choice((2, 3))) for _ in range(rounds)]
    return out


def payload(r: int) -> tuple[torch.Tensor, ...]:
    n = 1 + r % 7
    hidden = torch.arange(n * 16, dtype=torch.float32).reshape(1, n, 16) + 1000 * r
    return hidden, torch.full((1, n), r, dtype=torch.long)


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    status = Path(out) / f"rank-{rank}.txt"
    try:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=TIMEOUT_S))
        dist.barrier()
        transport = make_transport("gloo", torch.device("cpu"))
        for r, src, dst in schedule():  # this rank's rounds, increasing
            if rank == src:
                status.write_text(f"sending round {r} to {dst}")
                transport.send(payload(r), dst, r)
            elif rank == dst:
                status.write_text(f"receiving round {r} from {src}")
                lease, _ = transport.recv(describe(payload(r)), src, r)
                for a, b in zip(lease.tensors, payload(r), strict=True):
                    assert torch.equal(a, b), f"round {r}: rank {dst} got another round's tensor"
                transport.release(lease)
        status.write_text("done")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        status.write_text("failed: " + traceback.format_exc().splitlines()[-1])
        raise


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_random_crossed_schedules_finish_and_deliver_each_round_to_its_drafter(tmp_path: Path) -> None:
    crossed = schedule()
    assert any(a[1] != b[1] and a[2] != b[2] for a, b in itertools.pairwise(crossed))  # pairs do cross
    ctx = mp.start_processes(_rank, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S * 2
    try:
        while not ctx.join(timeout=1) and time.monotonic() < deadline:
            pass
    except mp.ProcessRaisedException as exc:
        pytest.fail(f"a rank failed: {exc}")
    except mp.ProcessExitedException as exc:
        pytest.fail(f"a rank exited: {exc}")
    finally:
        alive = [p for p in ctx.processes if p.is_alive()]
        if alive:
            states = sorted((tmp_path / f"rank-{r}.txt").read_text() for r in range(WORLD)
                            if (tmp_path / f"rank-{r}.txt").exists())
            for p in alive:
                p.kill()
            pytest.fail(f"deadlocked on ranks: {states}")
