"""Run telemetry for the trainer: GPU sampling, stage timings, rolling mix metrics, queue health, W&B.

Everything here is optional to the run: a missing NVML, a W&B that fails to start or to log, is
reported once (through ``warn``, default :mod:`logging`) and the run carries on without it. Each part
returns flat ``{key: number}`` dicts under the metric names of docs/ARCHITECTURE.md / issue 5, so one merged
dict goes to both W&B and the local records (nothing depends on W&B being reachable). Neither
``wandb`` nor ``pynvml`` is imported until a part that needs it starts; torch-free.

Parts:

- :class:`NvmlSampler`: background thread sampling per-GPU utilisation, memory, power, temperature
  and SM clock every ``interval_s``; :func:`gpu_metrics` turns drained samples into ``gpu/<i>/...``.
- :class:`RollingMix`: docs/ARCHITECTURE.md's mix metrics (:func:`dflash.core.mixmetrics.mix_metrics`) over the
  last N taken items.
- :class:`WandbLogger`: ``offline`` (default; ``wandb sync DIR`` uploads later), ``online`` or
  ``disabled`` (imports nothing).

Example, the trainer's side (one logging interval)::

    gpus = NvmlSampler(interval_s=5, clock=queue.now, warn=progress).start()
    mix = RollingMix(p=sampler.item_mix(), window=cfg.metrics.window)
    wb = WandbLogger(mode, out_dir, config=cfg.to_dict(), run_name=run_id, warn=progress)
    ...                                     # in the loops:
    mix.add_take(entry.bucket, [i.padded_len for i in items])   # per take, in take order
    ...                                     # every log interval:
    now = queue.now()
    m = {"loss": loss, "lr": lr, "tokens_per_s": tok_s, "samples_per_s": smp_s,
         **mix.metrics(), **gpu_metrics(gpus.drain())}
    records.write("step", t=now, step=step, ..., telemetry=m)   # same values in the local records
    wb.log(m, step=step)
    ...
    wb.event("queue_control", {"accepted": True, "min_ready": 30}, step=step)   # a live change
    gpus.stop(); wb.finish()
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dflash.core.mixmetrics import mix_metrics

logger = logging.getLogger("dflash.pipeline.telemetry")

Warn = Callable[[str], None]

WANDB_MODES = ("offline", "online", "disabled")
GIB = 1024 ** 3

_wandb_runs_lock = threading.Lock()
_wandb_runs_open = 0  # W&B runs of this process not yet finished (teardown only after the last)


def _default_warn(msg: str) -> None:
    logger.warning(msg)


# ====================================================================== NVML
def nvml_device_for(cuda_index: int, visible: str | None) -> int | str:
    """The NVML device behind torch's ``cuda:cuda_index``: NVML counts physical GPUs and ignores
    ``CUDA_VISIBLE_DEVICES`` (``visible``), torch counts the visible ones. An index where the list
    names indices, the list's entry (a ``GPU-...``/``MIG-...`` UUID) where it names UUIDs."""
    if visible is None or not visible.strip():
        return cuda_index
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if not 0 <= cuda_index < len(entries):
        raise ValueError(f"cuda:{cuda_index} is not among CUDA_VISIBLE_DEVICES={visible!r}")
    entry = entries[cuda_index]
    return int(entry) if entry.isdigit() else entry


class NvmlSampler:
    """Samples every visible GPU through NVML in a daemon thread.

    ``nvml`` is the ``pynvml`` module (imported at :meth:`start` when None) or any object with the
    same functions; ``indices`` limits the GPUs: NVML indices, which are physical and ignore
    ``CUDA_VISIBLE_DEVICES`` (:func:`nvml_device_for` maps a torch index), or UUID strings.
    ``clock`` stamps samples (pass ``queue.now`` for record time).
    Without NVML, :meth:`start` reports once through ``warn`` and the sampler stays idle.

    A sample is ``{"t", "gpu", "util", "mem_util", "mem_used", "mem_total", "power_w", "temp_c",
    "sm_clock_mhz"}`` (bytes, %, W, C, MHz); a field the GPU does not report is None.
    """

    def __init__(self, interval_s: float = 5.0, *, nvml: Any = None, indices: Sequence[int | str] | None = None,
                 warn: Warn | None = None, clock: Callable[[], float] = time.time,
                 max_samples: int = 100_000) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.interval_s = interval_s
        self._nvml = nvml
        self._indices = None if indices is None else list(indices)
        self._warn = warn or _default_warn
        self._clock = clock
        self._lock = threading.Lock()
        self._samples: deque[dict[str, Any]] = deque(maxlen=max_samples)
        self._latest: dict[int, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handles: list[tuple[int | str, Any]] = []
        self._warned_sample = False
        self.available = False
        self.unavailable_reason: str | None = None

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> NvmlSampler:
        """Initialise NVML and start sampling (one sample at once, then every ``interval_s``)."""
        if self._thread is not None or self.unavailable_reason is not None:
            return self
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            self._nvml.nvmlInit()
            count = int(self._nvml.nvmlDeviceGetCount())
            wanted = range(count) if self._indices is None else self._indices
            self._handles = [(i, self._nvml.nvmlDeviceGetHandleByUUID(i)) if isinstance(i, str)
                             else (i, self._nvml.nvmlDeviceGetHandleByIndex(i)) for i in wanted
                             if isinstance(i, str) or 0 <= i < count]
            if not self._handles:
                raise RuntimeError("no GPU found")
        except Exception as exc:  # no driver, no library, no GPU: telemetry off, the run goes on
            self.unavailable_reason = f"{type(exc).__name__}: {exc}"
            self._warn(f"NVML unavailable ({self.unavailable_reason}): GPU telemetry off")
            self._shutdown_nvml()
            return self
        self.available = True
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="nvml-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and shut NVML down; idempotent (samples taken stay readable)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout=max(5.0, 2 * self.interval_s))
        self._shutdown_nvml()

    def __enter__(self) -> NvmlSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- reading
    def latest(self) -> list[dict[str, Any]]:
        """The most recent sample of each GPU (empty without NVML or before the first sample)."""
        with self._lock:
            return [dict(self._latest[i]) for i in sorted(self._latest)]

    def drain(self) -> list[dict[str, Any]]:
        """Every sample taken since the last drain, oldest first."""
        with self._lock:
            out = list(self._samples)
            self._samples.clear()
        return out

    def sample_now(self) -> list[dict[str, Any]]:
        """Take one sample of every GPU in the caller's thread (also what the thread does)."""
        if not self.available:
            return []
        t = self._clock()
        out = [self._read(i, h, t) for i, h in self._handles]
        with self._lock:
            self._samples.extend(out)
            for s in out:
                self._latest[s["gpu"]] = s
        return out

    # ---------------------------------------------------------------- internals
    def _loop(self) -> None:
        from dflash.pipeline.abort import handed_off
        from dflash.pipeline.faults import fault

        # NVML failing to read a GPU is expected (a warning, and the next sample); anything else that ends the
        # thread (its own code, a BaseException) is the rank's failure, never a silent stop (dflash.pipeline.abort)
        with handed_off("the telemetry thread"):
            while True:
                try:
                    self.sample_now()
                except Exception as exc:  # never let NVML take the run down
                    self._warn_sample(exc)
                fault("telemetry.sample")
                if self._stop.wait(self.interval_s):
                    return

    def _read(self, index: int, handle: Any, t: float) -> dict[str, Any]:
        nv = self._nvml
        s: dict[str, Any] = {"t": t, "gpu": index}
        util = self._field(lambda: nv.nvmlDeviceGetUtilizationRates(handle))
        s["util"] = None if util is None else float(util.gpu)
        s["mem_util"] = None if util is None else float(util.memory)
        mem = self._field(lambda: nv.nvmlDeviceGetMemoryInfo(handle))
        s["mem_used"] = None if mem is None else int(mem.used)
        s["mem_total"] = None if mem is None else int(mem.total)
        power = self._field(lambda: nv.nvmlDeviceGetPowerUsage(handle))  # milliwatts
        s["power_w"] = None if power is None else power / 1000.0
        temp = self._field(lambda: nv.nvmlDeviceGetTemperature(handle, getattr(nv, "NVML_TEMPERATURE_GPU", 0)))
        s["temp_c"] = None if temp is None else float(temp)
        clock = self._field(lambda: nv.nvmlDeviceGetClockInfo(handle, getattr(nv, "NVML_CLOCK_SM", 1)))
        s["sm_clock_mhz"] = None if clock is None else float(clock)
        return s

    def _field(self, read: Callable[[], Any]) -> Any:
        try:
            return read()
        except Exception as exc:  # e.g. NVMLError_NotSupported for power on some boards
            self._warn_sample(exc)
            return None

    def _warn_sample(self, exc: BaseException) -> None:
        if not self._warned_sample:
            self._warned_sample = True
            self._warn(f"NVML sample failed ({type(exc).__name__}: {exc}); such fields are left empty")

    def _shutdown_nvml(self) -> None:
        if self._nvml is None:
            return
        with contextlib.suppress(Exception):
            self._nvml.nvmlShutdown()


GPU_FIELDS = {  # sample field -> (metric name, reduction over the interval, scale)
    "util": ("util", "mean", 1.0),
    "mem_util": ("mem_util", "mean", 1.0),
    "mem_used": ("mem_used_gib", "max", 1.0 / GIB),
    "mem_total": ("mem_total_gib", "max", 1.0 / GIB),
    "power_w": ("power_w", "mean", 1.0),
    "temp_c": ("temp_c", "max", 1.0),
    "sm_clock_mhz": ("sm_clock_mhz", "mean", 1.0),
}


def gpu_metrics(samples: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """``gpu/<i>/<field>`` over an interval's samples: means of util, power and clock; maxima of memory
    (GiB) and temperature. Empty for no samples."""
    by_gpu: dict[int, dict[str, list[float]]] = {}
    for s in samples:
        g = by_gpu.setdefault(int(s["gpu"]), {})
        for field in GPU_FIELDS:
            v = s.get(field)
            if v is not None:
                g.setdefault(field, []).append(float(v))
    out: dict[str, float] = {}
    for i in sorted(by_gpu):
        for field, vals in by_gpu[i].items():
            name, how, scale = GPU_FIELDS[field]
            v = sum(vals) / len(vals) if how == "mean" else max(vals)
            out[f"gpu/{i}/{name}"] = v * scale
    return out


# ====================================================================== stage timings
def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between order statistics (numpy's default)."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# ====================================================================== rolling mix
MIX_KEYS = ("mix_entropy", "mix_efficiency", "mix_kl", "length_autocorr", "max_bucket_streak")


class RollingMix:
    """docs/ARCHITECTURE.md's mix metrics over the last ``max_items`` taken items (default 32 windows of W).

    Feed every take in global take order with :meth:`add_take` (or :meth:`add_entry` for a take log
    entry / take record); a take cut by the rolling edge still counts once for streaks. ``p`` is the
    item mix (``sampler.item_mix()``), ``window`` docs/ARCHITECTURE.md's W.
    """

    def __init__(self, p: Sequence[float], window: int = 32, max_items: int | None = None) -> None:
        if window < 2:
            raise ValueError("window must be >= 2")
        self.p = list(p)
        self.window = window
        self.max_items = max_items if max_items is not None else 32 * window
        if self.max_items < window:
            raise ValueError("max_items must be >= window")
        self._lock = threading.Lock()
        self._items: deque[tuple[int, float, int]] = deque(maxlen=self.max_items)  # bucket, padded_len, take
        self._takes = 0

    def add_take(self, bucket: int, padded_lens: Sequence[float]) -> None:
        """One take: its bucket and the padded length of each item it took."""
        with self._lock:
            seq = self._takes
            self._takes += 1
            self._items.extend((bucket, float(n), seq) for n in padded_lens)

    def add_entry(self, entry: Any, padded_lens: Sequence[float]) -> None:
        """A take record (or any object with ``bucket`` and ``item_ids``), with its items' padded lengths."""
        bucket = entry["bucket"] if isinstance(entry, Mapping) else entry.bucket
        ids = entry["item_ids"] if isinstance(entry, Mapping) else entry.item_ids
        if len(ids) != len(padded_lens):
            raise ValueError(f"take of {len(ids)} items given {len(padded_lens)} padded lengths")
        self.add_take(bucket, padded_lens)

    def data(self) -> tuple[list[int], list[float], list[int]]:
        """(item buckets, item padded lengths, take buckets) in the rolling window, oldest first."""
        with self._lock:
            items = list(self._items)
        take_buckets, prev = [], None
        for b, _, seq in items:
            if seq != prev:
                take_buckets.append(b)
                prev = seq
        return [b for b, _, _ in items], [n for _, n, _ in items], take_buckets

    def metrics(self) -> dict[str, float]:
        """``mix_entropy``, ``mix_efficiency``, ``mix_kl``, ``length_autocorr``, ``max_bucket_streak``
        (NaN until a full window has been taken) and ``mix_items`` (items in the rolling window)."""
        buckets, lens, takes = self.data()
        d = mix_metrics(buckets, lens, takes, self.p, self.window).as_dict()
        out: dict[str, float] = {k: d[k] for k in MIX_KEYS}
        out["mix_items"] = len(buckets)
        return out


# ====================================================================== W&B
def _jsonable(value: Any) -> Any:
    """A plain JSON tree (tuples -> lists, unknown objects -> str) that wandb's config accepts."""
    return json.loads(json.dumps(value, default=str))


def flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> ``a/b`` keys, lists/tuples of numbers -> ``a/0``, ``a/1``; None dropped."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{key}/"))
        elif isinstance(v, (list, tuple)):
            out.update(flatten({str(i): x for i, x in enumerate(v)}, f"{key}/"))
        elif v is not None:
            out[key] = v
    return out


class WandbLogger:
    """Logs a run to W&B, ``offline`` by default (under ``run_dir/wandb/offline-run-*``; upload later
    with ``wandb sync``), ``online`` with the user's credentials, or ``disabled`` (wandb is never
    imported). Never raises: a failed start is reported once and the logger goes disabled; a failed
    log is reported once and logging stops. Online without credentials, or whose start fails (server
    unreachable, key rejected), falls back to offline.

    W&B's own system monitor is off by default (``system_stats=False``): :class:`NvmlSampler`
    provides the GPU values, and the monitor's hardware probes are what could reach out on a box
    without network.
    """

    def __init__(self, mode: str = "offline", run_dir: str | Path = ".", config: Mapping[str, Any] | None = None,
                 run_name: str | None = None, project: str = "dflash-tune", *, run_id: str | None = None,
                 tags: Sequence[str] | None = None, warn: Warn | None = None, system_stats: bool = False,
                 init_timeout_s: float = 90.0) -> None:
        if mode not in WANDB_MODES:
            raise ValueError(f"wandb mode must be one of {WANDB_MODES}, got {mode!r}")
        self.requested_mode = mode
        self.mode = mode  # the effective mode: offline, online or disabled
        self.run_dir = Path(run_dir)
        self._warn = warn or _default_warn
        self._lock = threading.Lock()
        self._run: Any = None
        self._last_step = -1
        self._events: dict[str, int] = {}
        self.init_s: float | None = None
        if mode == "disabled":
            return
        t0 = time.perf_counter()
        args = (config, run_name, project, run_id, tags, system_stats, init_timeout_s)
        try:
            self._run = self._init(mode, *args)
        except BaseException as exc:  # wandb raises UsageError/CommError (and can sys.exit): never fatal
            if isinstance(exc, KeyboardInterrupt):
                raise
            self._run = None
            why = f"{type(exc).__name__}: {_first_line(exc)}"
            if self.mode == "online":  # unreachable server, rejected key: keep the run for `wandb sync`
                self._warn(f"W&B online could not start ({why}); logging offline instead")
                self._init_offline_fallback(*args)
            else:
                self._warn(f"W&B could not start ({why}): W&B logging off")
                self.mode = "disabled"
        self.init_s = time.perf_counter() - t0

    def _init_offline_fallback(self, *args: Any) -> None:
        try:
            self._run = self._init("offline", *args)
        except Exception as exc:
            self._warn(f"W&B could not start offline either ({type(exc).__name__}: {_first_line(exc)}): "
                       "W&B logging off")
            self._run = None
            self.mode = "disabled"

    def _init(self, mode: str, config: Mapping[str, Any] | None, run_name: str | None, project: str,
              run_id: str | None, tags: Sequence[str] | None, system_stats: bool, init_timeout_s: float) -> Any:
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        os.environ["WANDB_MODE"] = mode
        if mode == "online" and not wandb.login(prompt=False, verify=False):
            self._warn("W&B online needs credentials (WANDB_API_KEY or `wandb login`); logging offline instead")
            mode = os.environ["WANDB_MODE"] = "offline"
        self.mode = mode
        self.run_dir.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(
            mode=mode, silent=True, console="off", save_code=False, disable_code=True,
            x_disable_stats=not system_stats, x_disable_machine_info=not system_stats,
            init_timeout=init_timeout_s)
        kwargs: dict[str, Any] = {}
        if run_id is not None:
            kwargs.update(id=run_id, resume="allow")
        run = wandb.init(project=project, name=run_name, dir=str(self.run_dir), mode=mode,
                         config=_jsonable(dict(config or {})), tags=list(tags) if tags else None,
                         settings=settings, reinit="create_new", **kwargs)
        global _wandb_runs_open
        with _wandb_runs_lock:
            _wandb_runs_open += 1
        return run

    # ---------------------------------------------------------------- state
    @property
    def active(self) -> bool:
        return self._run is not None

    @property
    def local_dir(self) -> Path | None:
        """The run's local folder (``.../wandb/offline-run-*`` offline), or None."""
        run = self._run
        if run is None:
            return None
        try:
            return Path(run.dir).parent  # run.dir is <run folder>/files
        except Exception:
            return None

    @property
    def sync_command(self) -> str | None:
        """What uploads an offline run later (``wandb sync <folder>``)."""
        d = self.local_dir
        return f"wandb sync {d}" if d is not None and self.mode == "offline" else None

    # ---------------------------------------------------------------- logging
    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log one interval's values (nested dicts/lists flattened to ``a/b``, ``a/0``).

        ``step`` must not go backwards in W&B; an older step is logged at the latest one instead.
        """
        if self._run is None:
            return
        data = flatten(metrics)
        with self._lock:
            step = self._step(step)
            self._call(lambda: self._run.log(data, step=step))

    def event(self, name: str, payload: Mapping[str, Any], step: int | None = None) -> None:
        """A discrete event (e.g. a live queue change): numeric payload values are logged as
        ``event/<name>/<key>`` at ``step``, the whole payload goes to the summary as
        ``event/<name>/last`` (JSON) with ``event/<name>/count``; offline-safe (no alert)."""
        if self._run is None:
            return
        flat = flatten(payload)
        numeric = {f"event/{name}/{k}": (float(v) if isinstance(v, bool) else v)
                   for k, v in flat.items() if isinstance(v, (int, float))}
        with self._lock:
            step = self._step(step)
            count = self._events[name] = self._events.get(name, 0) + 1

            def _do() -> None:
                self._run.log({**numeric, f"event/{name}/count": count}, step=step)
                self._run.summary[f"event/{name}/last"] = json.dumps(
                    {"step": step, **_jsonable(dict(payload))}, sort_keys=True)
                self._run.summary[f"event/{name}/count"] = count

            self._call(_do)

    def summary(self, values: Mapping[str, Any]) -> None:
        """Set run summary values (e.g. the final summary record's counts)."""
        if self._run is None:
            return
        data = flatten(values)
        with self._lock:
            self._call(lambda: self._run.summary.update(data))

    def finish(self, exit_code: int | None = None) -> None:
        """Close the run and, after the process's last open run, tear W&B down; idempotent.

        ``run.finish()`` alone can return before wandb's service has written the offline ``.wandb``
        file (seen with 0.31: sometimes only its 7-byte header right after finish); ``wandb.teardown()``
        waits for it, so the files are complete when this returns.
        """
        with self._lock:
            run, self._run = self._run, None
        if run is None:
            return
        try:
            run.finish(exit_code=exit_code)
        except Exception as exc:
            self._warn(f"W&B finish failed ({type(exc).__name__}: {_first_line(exc)})")
        _release_run(exit_code)

    def __enter__(self) -> WandbLogger:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.finish(exit_code=1 if exc_type is not None else None)

    # ---------------------------------------------------------------- internals
    def _step(self, step: int | None) -> int | None:
        if step is None:
            return None
        step = max(int(step), self._last_step)
        self._last_step = step
        return step

    def _call(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # never fatal; stop logging after the first failure
            self._warn(f"W&B logging failed ({type(exc).__name__}: {_first_line(exc)}): W&B logging off")
            run, self._run = self._run, None
            with contextlib.suppress(Exception):
                run.finish(exit_code=1)
            _release_run(1)


def _release_run(exit_code: int | None) -> None:
    global _wandb_runs_open
    with _wandb_runs_lock:
        _wandb_runs_open = max(0, _wandb_runs_open - 1)
        last = _wandb_runs_open == 0
    if last:
        import wandb

        with contextlib.suppress(Exception):
            wandb.teardown(exit_code)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
