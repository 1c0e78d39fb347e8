"""The check's JSON, written on every exit, and the verbs it runs, stopped in time to write it.

Why: a check that dies without its JSON tells the user nothing about where their node failed. So
the result is one dict filled as each stage finishes (:class:`Report`); whatever ends the check (a
verb's failure, an unexpected exception, SIGTERM from the wrapper's ``timeout`` or a scheduler, the
check's own ``--time-limit``, Ctrl-C) the dict is written, with ``failed_stage`` and a one-line
``error`` when the check did not finish. Each verb runs in its own process group (:func:`run_verb`),
so stopping it stops its ranks too, and the time limit stops the running verb ``RESERVE_S`` before
the limit, which is the room left to write the JSON.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dflash.gpucheck.plan import JSON_KEYS, LEARNING_KEYS, RESERVED_NOTE, Plan

RESERVE_S = 15.0  # before the time limit: stop the running verb (SIGTERM, then SIGKILL after 5 s), write the JSON
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding ``dflash`` (a checkout or site-packages)


class StepFailed(Exception):
    """A dflash verb of the loop failed: one line naming the step and its log."""


class Stopped(BaseException):
    """The check was stopped: SIGTERM, Ctrl-C or its own time limit. ``status``: its exit status."""

    def __init__(self, line: str, status: int) -> None:
        super().__init__(line)
        self.status = status


class Report:
    """The JSON of one check, filled stage by stage; :meth:`write` puts it in place atomically."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.t0 = time.monotonic()
        keys = LEARNING_KEYS if plan.learning else JSON_KEYS
        self.res: dict[str, Any] = dict.fromkeys(keys)
        self.res.update(mode="learning" if plan.learning else "default", failed_steps=[],
                        time_limit_s=plan.time_limit_s, target=plan.target)
        for key in ("mfu", "wait_peers_s", "shared_gpu"):
            self.res[key] = {"value": None, "note": RESERVED_NOTE}
        self.stage = "preflight"

    # --- time
    def remaining_s(self) -> float | None:
        """Seconds a verb may still run before the JSON must be written (None: no limit)."""
        if self.plan.time_limit_s is None:
            return None
        return self.plan.time_limit_s - RESERVE_S - (time.monotonic() - self.t0)

    # --- outcome
    def fail(self, line: str) -> None:
        """The check ends here: the stage it was in and the one line why."""
        self.res["failed_stage"] = self.stage
        self.res["error"] = " ".join(line.split())

    def step_failed(self, stage: str, line: str) -> None:
        """A later step failed but the check goes on: its figures are null, the line says why."""
        self.res["failed_steps"].append(line)
        if self.res["failed_stage"] is None:
            self.res["failed_stage"], self.res["error"] = stage, " ".join(line.split())

    def write(self) -> Path | None:
        self.res["wall_s"] = time.monotonic() - self.t0
        out = self.plan.json_out
        if out is None:
            return None
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.partial")
        tmp.write_text(json.dumps(self.res, indent=1, default=str))
        os.replace(tmp, out)
        return out


def raise_stopped(signum: int, _frame: Any) -> None:
    """SIGTERM handler: unwind the main thread (the running verb is stopped on the way out)."""
    raise Stopped(f"stopped by signal {signal.Signals(signum).name}", 128 + signum)


def verb_env(cpu: bool) -> dict[str, str]:
    """The verbs' environment: this dflash first on the path (a checkout run with PYTHONPATH, or the
    installed package), unbuffered output, wandb off, and no GPU for ``--cpu``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH"))
                                                        if p),
           "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_verb(report: Report, args: list[str], log: Path, env: dict[str, str], step: str,
             sampler: Any | None = None) -> str:
    """``python -m dflash ARGS`` in its own process group; output to ``log`` (and returned).

    A failure is :class:`StepFailed` (one line naming the step, its exit status, its last line and
    the log). The check's time limit or a signal stops the verb's whole group (SIGTERM, SIGKILL 5 s
    later) before the exception leaves here, so no rank outlives the check.
    """
    report.stage = step
    t0 = time.perf_counter()
    remaining = report.remaining_s()
    if remaining is not None and remaining <= 0:
        raise Stopped(f"time limit of {report.plan.time_limit_s:g} s reached before {step}", 124)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dflash", *args], cwd=log.parent, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        if sampler is not None:
            sampler.start(proc.pid)
        try:
            rc = proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            raise Stopped(f"time limit of {report.plan.time_limit_s:g} s reached during {step}", 124) from None
        finally:
            if proc.poll() is None:
                _stop_group(proc)
            if sampler is not None:
                sampler.finish()
    text = log.read_text(errors="replace")
    last = (text.strip().splitlines() or [""])[-1]
    print(f"gpu-check: {step} in {time.perf_counter() - t0:.0f} s (log {log})", flush=True)
    if rc != 0:
        raise StepFailed(f"gpu-check: {step} failed (exit status {rc}): {last} (log {log})")
    return text


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
