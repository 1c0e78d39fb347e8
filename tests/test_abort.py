"""The abort path's pieces on their own (dflash/pipeline/abort.py): a thread's failure reaches the rank (the
watchdog reports it when the owner does not), the NVML telemetry thread hands over what ends it, the heartbeat
travels a real control channel and its silence names the dead rank, and a SIGTERM after a peer failed makes a
rank leave at once even while its main thread is busy. The whole path in real jobs: tests/test_fault_matrix.py.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash.pipeline import abort, faults
from dflash.pipeline import messages as m
from dflash.pipeline.abort import AbortOnPeerFailure, Heartbeat, RankFailure, heartbeat_timeout_s
from dflash.pipeline.channel import Hub, connect
from dflash.pipeline.telemetry import NvmlSampler
from tests.test_telemetry import StandInNvml


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def rank_failure(monkeypatch: pytest.MonkeyPatch) -> tuple[RankFailure, list[tuple[BaseException, float]]]:
    """A fresh rank failure whose 'exit' records what it would report (the real one ends the process)."""
    exits: list[tuple[BaseException, float]] = []
    failure = RankFailure(grace_s=0.05)
    failure.install(lambda exc: exits.append((exc, time.monotonic())))
    monkeypatch.setattr(abort, "FAILURE", failure)
    monkeypatch.setattr(faults, "_counts", {})
    return failure, exits


def test_the_watchdog_reports_a_threads_failure_the_owner_did_not_raise(rank_failure) -> None:
    failure, exits = rank_failure
    first, later = RuntimeError("CUDA out of memory"), RuntimeError("a peer's loss, after")
    t0 = time.monotonic()
    failure.fail(first, "the producer's reader")
    failure.fail(later, "the producer's sender")  # the first failure is the rank's
    wait_for(lambda: exits)
    assert exits[0][0] is first and exits[0][1] - t0 >= 0.05  # the owner had its grace
    assert failure.where == "the producer's reader" and not failure.claim()  # nobody reports it twice
    time.sleep(0.05)
    assert len(exits) == 1


def test_an_owner_that_raises_first_keeps_the_report(rank_failure) -> None:
    failure, exits = rank_failure
    failure.fail(RuntimeError("x"), "the producer's sender")
    assert failure.claim()  # the owner (rank_main) reports it itself
    time.sleep(0.15)
    assert exits == []


def test_the_telemetry_thread_hands_over_what_ends_it_and_still_only_warns_on_nvml(rank_failure, monkeypatch) -> None:
    failure, exits = rank_failure
    failure.grace_s = 5.0  # what an owner would get; the sampler has none
    monkeypatch.setenv(faults.FAULT_ENV, "telemetry.sample:3")
    nv = StandInNvml()
    warned: list[str] = []
    s = NvmlSampler(interval_s=0.01, nvml=nv, indices=[1], warn=warned.append)  # GPU 1 reports no power: fine
    t0 = time.monotonic()
    with s:
        wait_for(lambda: exits)
    assert isinstance(exits[0][0], faults.InjectedFault) and failure.where == "the telemetry thread"
    assert exits[0][1] - t0 < 2.0  # nobody waits on the sampler: the rank fails at once, no grace
    assert len(s.drain()) == 3  # it sampled until the fault, through NVML's own failures (a warning, once)
    assert len(warned) == 1 and "NVML sample failed (NotSupported" in warned[0]


def test_the_heartbeat_travels_the_control_channel_and_a_closed_one_ends_it_quietly(rank_failure) -> None:
    failure, _ = rank_failure
    hub = Hub("127.0.0.1")
    ch = connect("127.0.0.1", hub.port, 3, 5.0)
    hub.accept([3], 5.0)
    beat = Heartbeat(lambda: ch.send(m.Beat()), interval_s=0.05).start()
    got: list[tuple[int, m.Message]] = []
    deadline = time.monotonic() + 5
    while len(got) < 2 and time.monotonic() < deadline:
        got += hub.poll(0.1)
    assert got[:2] == [(3, m.Beat()), (3, m.Beat())]
    hub.close()  # the coordinator is gone: the rank's reader reports that, not the heartbeat
    ch.close()
    beat._thread.join(5)
    assert not beat._thread.is_alive() and failure.error is None


def test_a_failing_heartbeat_is_the_ranks_failure(rank_failure, monkeypatch) -> None:
    failure, exits = rank_failure
    monkeypatch.setenv(faults.FAULT_ENV, "heartbeat.beat:2@0")
    monkeypatch.setenv("RANK", "0")
    sent: list[int] = []
    Heartbeat(lambda: sent.append(1), interval_s=0.02).start()
    wait_for(lambda: exits)
    assert sent == [1] and isinstance(exits[0][0], faults.InjectedFault) and failure.where == "heartbeat"


def test_a_fault_planned_on_another_rank_does_not_fire_here(monkeypatch) -> None:
    monkeypatch.setattr(faults, "_counts", {})
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv(faults.FAULT_ENV, "status.write:1@0")
    faults.fault("status.write")
    monkeypatch.setenv(faults.FAULT_ENV, "status.write:1@x")
    with pytest.raises(ValueError, match="<site>:<n>\\[@<rank>\\]"):
        faults.fault("status.write")


def test_a_silent_rank_fails_the_coordinator_naming_it() -> None:
    from dflash.pipeline.service import CoordinatorService

    service = SimpleNamespace(_byes={2: m.Bye()})  # the one field _check_alive reads
    now = time.monotonic()
    CoordinatorService._check_alive(service, {0: now - 1, 2: now - 99}, now, 30.0)  # rank 2 said bye: not silent
    with pytest.raises(RuntimeError, match="rank 0 sent nothing, not even a heartbeat, for 31 s"):
        CoordinatorService._check_alive(service, {0: now - 31, 1: now}, now, 30.0)


@pytest.mark.parametrize("raw", ["x", "1", "-5"])
def test_a_bad_heartbeat_timeout_is_refused(monkeypatch, raw) -> None:
    monkeypatch.setenv(abort.HEARTBEAT_ENV, raw)
    with pytest.raises(ValueError, match="DFLASH_HEARTBEAT_S"):
        heartbeat_timeout_s()
    monkeypatch.setenv(abort.HEARTBEAT_ENV, "7.5")
    assert heartbeat_timeout_s() == 7.5


def test_a_sigterm_after_a_peer_failed_leaves_at_once_while_the_main_thread_is_busy(tmp_path: Path) -> None:
    """The launcher's SIGTERM: a clean stop while every rank is well; leaving now once another rank failed."""
    stops: list[int] = []
    left: list[str] = []
    old = signal.signal(signal.SIGTERM, lambda signum, _f: stops.append(signum))  # the rank's clean-stop handler
    try:
        watch = AbortOnPeerFailure(tmp_path, 1, left.append)
        watch.install()
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(lambda: stops)
        time.sleep(0.05)
        assert left == []  # no peer failed: the normal clean stop
        (tmp_path / "rank-1.error").write_text("{}")  # this rank's own error is no peer's
        (tmp_path / "rank-0.error").write_text("{}")
        busy = threading.Event()

        def kill_soon() -> None:
            busy.wait(5)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=kill_soon, daemon=True).start()
        busy.set()
        t0 = time.monotonic()
        while not left and time.monotonic() - t0 < 5:  # the main thread keeps computing: no handler runs here
            sum(range(1000))
        assert left == ["stopped because rank 0 failed"]
    finally:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, old)
