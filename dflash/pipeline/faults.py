"""Fault injection for tests: ``DFLASH_FAULT=<site>:<n>[@<rank>][,...]`` raises an unexpected exception at
the n-th pass (1-based) through a named site of a rank (of every rank, or of ``<rank>`` only), on the CPU
as on a GPU.

Why: a thread that dies on an exception nobody expected (a CUDA out-of-memory while taking a pool
buffer, an NCCL error, an IPC mapping error) used to end silently while its owner waited with no
timeout; the job then hung until the drafter's 600 s wait blamed the wrong rank. Each site below is a
place such an exception can happen; tests/test_fault_matrix.py puts one there and checks that the job
stops within seconds, names the failing rank and its traceback file, and resumes exactly.

Sites (the thread each runs in):

- ``producer.make``: a target rank computing an item (its main thread);
- ``producer.post_send``: posting an item's send (the producer's reader thread);
- ``producer.send_wait``: waiting for a posted send or its acknowledgement (the producer's sender thread);
- ``drafter.step``: a drafter rank starting an optimizer step (its main thread);
- ``coordinator.handle``: the coordinator handling a batch of messages (the host rank's coordinator thread);
- ``drafter.release``: a drafter rank giving back a received item, the acknowledgement on a sharing plane
  (its main thread);
- ``status.write``: writing the rank's status file (every rank's status thread);
- ``heartbeat.beat``: the rank's beat to the coordinator (every rank's heartbeat thread);
- ``telemetry.sample``: sampling the rank's GPU through NVML (a CUDA rank's telemetry thread).
"""

from __future__ import annotations

import os
import threading

FAULT_ENV = "DFLASH_FAULT"
SITES = ("producer.make", "producer.post_send", "producer.send_wait", "drafter.step", "coordinator.handle",
         "drafter.release", "status.write", "heartbeat.beat", "telemetry.sample")


class InjectedFault(RuntimeError):
    """The exception a fault site raises: unexpected by the code around it, as a real one would be."""


_counts: dict[str, int] = {}
_lock = threading.Lock()


def _plan() -> dict[str, int]:
    """The planned passes of this process: ``<site>:<n>`` on every rank, ``<site>:<n>@<rank>`` on one only
    (the threads every rank runs, the status writer and the heartbeat, would otherwise fail on all at once)."""
    out: dict[str, int] = {}
    for part in os.environ.get(FAULT_ENV, "").split(","):
        site, _, rest = part.strip().partition(":")
        n, _, rank = rest.partition("@")
        if site:
            if site not in SITES or not n.isdigit() or int(n) < 1 or (rank and not rank.isdigit()):
                raise ValueError(f"{FAULT_ENV}: {part!r} is not <site>:<n>[@<rank>] with a site of {', '.join(SITES)}")
            if not rank or int(rank) == int(os.environ.get("RANK", "0")):
                out[site] = int(n)
    return out


def fault(site: str) -> None:
    """Count a pass through ``site``; raise :class:`InjectedFault` at the planned pass. Costs a dict
    lookup when no fault is planned (the environment is read once per call: tests set it per job)."""
    if FAULT_ENV not in os.environ:
        return
    n = _plan().get(site)
    if n is None:
        return
    with _lock:
        _counts[site] = _counts.get(site, 0) + 1
        hit = _counts[site] == n
    if hit:
        raise InjectedFault(f"injected fault at {site} (pass {n}, {FAULT_ENV})")
