"""Telemetry: stage timings, rolling mix, queue health, NVML sampling and W&B (offline and disabled)."""

from __future__ import annotations

import math
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dflash.core.mixmetrics import mix_metrics
from dflash.pipeline.telemetry import (
    MIX_KEYS,
    NvmlSampler,
    RollingMix,
    WandbLogger,
    flatten,
    gpu_metrics,
    nvml_device_for,
    percentile,
)

REPO = Path(__file__).resolve().parents[1]


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-12, abs=1e-12)


# ---------------------------------------------------------------------- percentile
def test_percentile_matches_numpy() -> None:
    for q in (0, 50, 95, 100):
        assert percentile([3.0, 1.0, 2.0, 10.0], q) == pytest.approx(float(np.percentile([3, 1, 2, 10], q)))


# ---------------------------------------------------------------------- RollingMix
def test_rolling_mix_equals_mix_metrics_over_the_last_items() -> None:
    p = [0.1, 0.2, 0.3, 0.4]
    window, max_items = 8, 64
    mix = RollingMix(p, window=window, max_items=max_items)
    assert all(math.isnan(mix.metrics()[k]) for k in ("mix_entropy", "mix_efficiency", "mix_kl"))
    rng = random.Random(3)
    all_items: list[tuple[int, float, int]] = []  # bucket, padded_len, take number
    for take in range(150):
        b = rng.choices(range(4), weights=p)[0]
        lens = [float(128 * (b + 1) - rng.randint(0, 60)) for _ in range(rng.randint(1, 3))]
        if take % 2:
            mix.add_take(b, lens)
        else:
            mix.add_entry({"bucket": b, "item_ids": [f"i{take}-{j}" for j in range(len(lens))]}, lens)
        all_items.extend((b, n, take) for n in lens)
        if take in (3, 40, 149):
            last = all_items[-max_items:]
            takes = [b for k, (b, _, t) in enumerate(last) if k == 0 or last[k - 1][2] != t]
            want = mix_metrics([b for b, _, _ in last], [n for _, n, _ in last], takes, p, window).as_dict()
            got = mix.metrics()
            assert got["mix_items"] == len(last)
            for key in MIX_KEYS:
                assert same(got[key], want[key]), key
    assert mix.metrics()["mix_items"] == max_items
    with pytest.raises(ValueError):
        mix.add_entry({"bucket": 0, "item_ids": ["a", "b"]}, [1.0])


def wait_until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


# ---------------------------------------------------------------------- NVML
def test_nvml_sampler_on_this_machine_warns_once_without_nvml() -> None:
    import pynvml

    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        has_nvml = True
    except pynvml.NVMLError:
        has_nvml = False
    msgs: list[str] = []
    s = NvmlSampler(interval_s=0.05, warn=msgs.append)
    with s:
        s.start()  # a second start neither warns again nor starts a second thread
        if has_nvml:
            wait_until(lambda: len(s.latest()) > 0)
        else:
            time.sleep(0.1)
    if has_nvml:
        assert s.available and s.drain() and not msgs
    else:
        assert len(msgs) == 1, msgs
        assert msgs[0].startswith("NVML unavailable (") and msgs[0].endswith("): GPU telemetry off")
        assert not s.available and s.latest() == [] and s.drain() == [] and s.sample_now() == []
        assert gpu_metrics(s.drain()) == {}


class StandInNvml:
    """Stands in for the pynvml module (an external library): two GPUs with fixed readings;
    GPU 1 does not report power, as some boards do not."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1

    class NotSupported(Exception):
        pass

    def __init__(self) -> None:
        self.init_calls = self.shutdown_calls = 0

    def nvmlInit(self) -> None:  # pynvml's names
        self.init_calls += 1

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=90 + h, memory=40 + h)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(used=(h + 1) * 2 ** 30, total=80 * 2 ** 30, free=0)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        if h == 1:
            raise self.NotSupported("Not Supported")
        return 350_500  # mW

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        return 60 + h

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        assert clock == self.NVML_CLOCK_SM
        return 1980


def test_nvml_sampler_loop_with_a_stand_in_nvml() -> None:
    nv = StandInNvml()
    msgs: list[str] = []
    s = NvmlSampler(interval_s=0.01, nvml=nv, warn=msgs.append, clock=time.monotonic)
    with s:
        assert s.available
        wait_until(lambda: len(s.latest()) == 2)
        first = s.drain()
        more: list[dict] = []
        wait_until(lambda: len(more.extend(s.drain()) or more) >= 4)  # the loop keeps sampling
    after_stop = s.drain()
    time.sleep(0.03)
    assert s.drain() == []  # stopped: no more samples
    assert nv.init_calls == 1 and nv.shutdown_calls == 1
    assert len(msgs) == 1 and "NVML sample failed" in msgs[0]  # power on GPU 1, said once
    g0, g1 = s.latest()
    assert g0 == {"t": g0["t"], "gpu": 0, "util": 90.0, "mem_util": 40.0, "mem_used": 2 ** 30,
                  "mem_total": 80 * 2 ** 30, "power_w": 350.5, "temp_c": 60.0, "sm_clock_mhz": 1980.0}
    assert g1["gpu"] == 1 and g1["power_w"] is None and g1["util"] == 91.0
    samples = first + more + after_stop
    ts = [x["t"] for x in samples]
    assert ts == sorted(ts)
    m = gpu_metrics(samples)
    assert m["gpu/0/util"] == 90.0 and m["gpu/1/util"] == 91.0
    assert m["gpu/0/mem_used_gib"] == 1.0 and m["gpu/1/mem_used_gib"] == 2.0 and m["gpu/0/mem_total_gib"] == 80.0
    assert m["gpu/0/power_w"] == 350.5 and "gpu/1/power_w" not in m
    assert m["gpu/1/temp_c"] == 61.0 and m["gpu/0/sm_clock_mhz"] == 1980.0


def test_nvml_sampler_only_the_requested_gpus() -> None:
    s = NvmlSampler(nvml=StandInNvml(), indices=[1], interval_s=60)
    with s:
        wait_until(lambda: len(s.latest()) == 1)
    assert [x["gpu"] for x in s.drain()] == [1]


@pytest.mark.parametrize(("cuda", "visible", "device"), [
    (0, None, 0), (1, "", 1), (0, "3", 3), (1, "2, 5", 5), (0, "GPU-8f3e", "GPU-8f3e"), (1, "4,MIG-1a2b", "MIG-1a2b"),
])
def test_a_torch_gpu_maps_to_its_nvml_device_through_cuda_visible_devices(cuda, visible, device) -> None:
    assert nvml_device_for(cuda, visible) == device


def test_a_torch_gpu_outside_cuda_visible_devices_is_an_error() -> None:
    with pytest.raises(ValueError, match="cuda:2"):
        nvml_device_for(2, "0,1")


def test_nvml_sampler_finds_a_gpu_by_uuid() -> None:
    nv = StandInNvml()
    nv.nvmlDeviceGetHandleByUUID = lambda uuid: {"GPU-b": 1}[uuid]
    s = NvmlSampler(nvml=nv, indices=["GPU-b"], interval_s=60)
    with s:
        wait_until(lambda: len(s.latest()) == 1)
    assert [(x["gpu"], x["util"]) for x in s.drain()] == [("GPU-b", 91.0)]


# ---------------------------------------------------------------------- W&B
@pytest.fixture
def wandb_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The logger sets WANDB_MODE/WANDB_SILENT in os.environ: restore them after the test."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_wandb_offline_writes_a_syncable_run_under_run_dir(tmp_path: Path, wandb_env: None) -> None:
    msgs: list[str] = []
    wb = WandbLogger("offline", tmp_path, config={"queue": {"min_ready": 30, "policy": "random_item"},
                                                  "bounds": (128, 256)},
                     run_name="real-test", warn=msgs.append)
    assert wb.active and wb.mode == "offline" and not msgs
    assert wb.init_s is not None and wb.init_s < 30
    for step in range(3):
        wb.log({"loss": 2.0 - step, "lr": 1e-4, "tokens_per_s": 1000.0, "hs_depth": 5,
                "hs_depth/bucket_0": 2, "stage/backward_mean": 0.1, "gpu/0/util": 90.0,
                "mix_efficiency": math.nan}, step=step)
    wb.event("queue_control", {"accepted": True, "min_ready": 20, "policy": "stratified"}, step=2)
    wb.log({"loss": 0.5}, step=1)  # an older step: logged at the latest instead of dropped
    wb.summary({"produced": 10, "trained": 9})
    local = wb.local_dir
    assert wb.sync_command == f"wandb sync {local}"
    wb.finish()
    wb.finish()  # idempotent
    wb.log({"loss": 1.0}, step=5)  # after finish: a no-op
    assert not msgs

    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs == [local]
    files = list(local.glob("run-*.wandb"))
    assert len(files) == 1
    data = files[0].read_bytes()
    assert data.startswith(b":W&B")
    for key in (b"loss", b"hs_depth/bucket_0", b"stage/backward_mean", b"event/queue_control/min_ready",
                b"min_ready", b"real-test"):
        assert key in data, key
    exe = shutil.which("wandb") or str(Path(sys.executable).parent / "wandb")
    out = subprocess.run([exe, "sync", "--dry-run", str(local)], capture_output=True, text=True, timeout=60,
                         env={"PATH": str(Path(sys.executable).parent), "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert "Would sync 1 run" in out.stdout + out.stderr and files[0].name in out.stdout + out.stderr


def test_wandb_failed_start_is_reported_once_and_training_goes_on(tmp_path: Path, wandb_env: None) -> None:
    msgs: list[str] = []
    wb = WandbLogger("offline", tmp_path, config={}, run_name="x", project="bad/project", warn=msgs.append)
    assert not wb.active and wb.mode == "disabled" and wb.sync_command is None
    wb.log({"loss": 1.0}, step=0)
    wb.event("queue_control", {"min_ready": 3}, step=0)
    wb.finish()
    assert len(msgs) == 1 and msgs[0].startswith("W&B could not start (UsageError") and "W&B logging off" in msgs[0]


def test_wandb_disabled_imports_nothing_and_writes_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    code = (
        "import sys\n"
        "from dflash.pipeline.telemetry import WandbLogger, NvmlSampler\n"
        "assert 'wandb' not in sys.modules and 'pynvml' not in sys.modules\n"
        f"wb = WandbLogger('disabled', {str(run_dir)!r}, config={{'a': 1}}, run_name='r')\n"
        "wb.log({'loss': 1.0}, step=0); wb.event('queue_control', {'min_ready': 2}, step=0); wb.finish()\n"
        "assert not wb.active and wb.mode == 'disabled' and wb.sync_command is None\n"
        "assert 'wandb' not in sys.modules, 'wandb imported'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    assert not run_dir.exists()


def test_wandb_rejects_an_unknown_mode(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="offline"):
        WandbLogger("dryrun", tmp_path)


def test_flatten_nested_metrics() -> None:
    assert flatten({"loss": 1.0, "hs_depth": {"bucket_0": 2}, "depths": [1, 2], "skip": None}) == {
        "loss": 1.0, "hs_depth/bucket_0": 2, "depths/0": 1, "depths/1": 2}


def test_wandb_online_without_credentials_logs_offline(tmp_path: Path, wandb_env: None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("NETRC", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc, no wandb settings
    msgs: list[str] = []
    wb = WandbLogger("online", tmp_path / "run", config={"a": 1}, run_name="r", warn=msgs.append)
    assert wb.requested_mode == "online" and wb.mode == "offline" and wb.active
    wb.log({"loss": 1.0}, step=0)
    wb.finish()
    assert len(msgs) == 1 and "needs credentials" in msgs[0]
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))


def test_wandb_online_unreachable_server_falls_back_to_offline(tmp_path: Path, wandb_env: None,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "x" * 86)  # a key of the right shape; the server is a closed port
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    msgs: list[str] = []
    wb = WandbLogger("online", tmp_path, config={"a": 1}, run_name="r", warn=msgs.append, init_timeout_s=1)
    assert wb.mode == "offline" and wb.active
    wb.log({"loss": 1.0}, step=0)
    wb.finish()
    assert len(msgs) == 1 and msgs[0].startswith("W&B online could not start (") and "offline instead" in msgs[0]
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
