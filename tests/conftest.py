"""Shared fixtures: small real pieces, never fakes of our own code."""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from dflash.core.config import QueueConfig
from dflash.core.policies import POLICY_CLASSES
from dflash.core.queue_core import QueueItem

ALL_POLICIES = sorted(POLICY_CLASSES)

if os.environ.get("PYTEST_XDIST_WORKER"):  # one of the test command's two workers (pytest -n 2)
    # Two workers share the machine's cores. torch's OpenMP threads spin while they wait, and two spinning
    # pools on two cores made the in-process decoding tests 25x slower (tests/test_heldout.py: 57 s under
    # `-n 2`, 2 s alone). One thread a worker, and idle threads that sleep (inherited by the rank jobs the
    # tests start, which set their own thread counts), before any test module loads torch.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Per-sequence shares docs/REFERENCE.md measured on the packaged ShareGPT (max_len 2048).
SHAREGPT_SHARES = (0.024, 0.030, 0.102, 0.161, 0.684)
SHAREGPT_BOUNDS = (128, 256, 512, 1024, 2048)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Decoding runs many tiny ops; with two OpenMP threads on two busy cores their spin-waits made
    these tests 30-100x slower (measured, test_acceptance.py). One thread is as fast here when idle
    and robust when not. Modules opt in: ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=ALL_POLICIES)
def policy_name(request: pytest.FixtureRequest) -> str:
    return request.param


def make_item(i: int, bucket: int, nbytes: int = 0, padded_len: int | None = None) -> QueueItem:
    return QueueItem(item_id=f"i{i}", bucket=bucket, n_seqs=1, real_tokens=100,
                     padded_len=padded_len if padded_len is not None else 100 * (bucket + 1),
                     nbytes=nbytes)


def synthetic_lengths(n: int, seed: int = 0, shares=SHAREGPT_SHARES,
                      bounds=SHAREGPT_BOUNDS) -> list[int]:
    """Lengths whose bucket shares follow ``shares``, uniform inside each bucket."""
    rng = random.Random(seed)
    lows = (1, *(b + 1 for b in bounds[:-1]))
    out = []
    for _ in range(n):
        b = rng.choices(range(len(bounds)), weights=shares)[0]
        out.append(rng.randint(lows[b], bounds[b]))
    return out


def qcfg(**kw) -> QueueConfig:
    base = {"min_ready": 1, "max_depth": 8}
    base.update(kw)
    return QueueConfig(**base)


def load_script(path: Path) -> ModuleType:
    """A script outside the package (benchmarks/, scripts/) imported as a module under its file name,
    registered in ``sys.modules`` so its dataclasses and pickles resolve."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------- signals (issue #38)
def sigint_default() -> None:
    """``preexec_fn`` of every child a test interrupts with SIGINT: SIGINT back at its default in the child.

    A non-interactive shell starts a background job (``python -m pytest -q &``) with SIGINT ignored;
    the children inherit that, Python then installs no KeyboardInterrupt handler, and a test's Ctrl-C
    does nothing. With the default restored before ``exec`` the child gets Python's own handler, so such
    a test means the same however the suite was started (tests/test_signals.py proves it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def catches(pid: int, signum: int) -> bool:
    """True when process ``pid`` has a handler installed for ``signum`` (``SigCgt`` in /proc)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(mask >> (signum - 1) & 1)


def wait_until_catching(proc: subprocess.Popen, signum: int = signal.SIGTERM, timeout: float = 120.0) -> None:
    """Wait until the child has installed its handler (``dflash``'s entry does it first thing), so a
    test's signal never races the interpreter's start-up, however loaded the machine is."""
    deadline = time.monotonic() + timeout
    while not catches(proc.pid, signum):
        assert proc.poll() is None and time.monotonic() < deadline, f"pid {proc.pid} never caught signal {signum}"
        time.sleep(0.02)


def left_in_session(sid: int, within_s: float = 30.0) -> list[str]:
    """Processes still alive (not zombies) in session ``sid`` after ``within_s`` seconds: a child started
    with ``start_new_session=True`` leads its own session, and everything it started stays in it."""
    import psutil

    deadline = time.monotonic() + within_s
    while True:
        left = []
        for p in psutil.process_iter(["pid", "status", "cmdline"]):
            try:
                if os.getsid(p.pid) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    left.append(f"{p.pid}: {' '.join(p.info['cmdline'] or [])[:120]}")
            except (ProcessLookupError, PermissionError, psutil.Error):
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)
