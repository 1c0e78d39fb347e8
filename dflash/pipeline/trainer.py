"""Training from a library call: the rank job ``dflash train`` launches, started and read back.

dflash has one training loop, the rank job (:mod:`dflash.pipeline.launch`: one process per rank, so
1 + 1 is two processes, with the coordinator, the transport, the control channel and the ledger).
Validation blocks, the demo's calibration run, benchmarks and tests start it through :func:`train`
(or :class:`HeldJob`, the same job held between validation blocks: :mod:`dflash.pipeline.hold`),
so what they measure is what a user's ``dflash train`` runs. There is no in-process twin to keep in
step with it (issue #26: the in-process ``Trainer``/``HSQueue`` measured one process model and the
recommendation was applied on another).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.core.config import DflashConfig
from dflash.core.records import read_records
from dflash.core.signals import interrupt_for


class JobFailed(RuntimeError):
    """A rank failed; the message is the earliest rank's one line (its traceback is in ``RUN/.ranks``)."""


@dataclass(frozen=True)
class JobResult:
    out: Path
    summary: dict[str, Any]  # the run's last summary record (docs/ARCHITECTURE.md's counts)
    metrics: dict[str, Any]  # metrics.json, written by the host rank at the end


def train(cfg: DflashConfig, out: str | Path, *, resume: bool = False, quiet: bool = True,
          wandb: str = "disabled", wait_s: float = 600.0, pg_timeout_s: float = 600.0,
          check_transfers: bool = False) -> JobResult:
    """Run the rank job to its end (``cfg``'s limits) in ``out`` and return what it wrote.

    ``resume`` continues the run's newest verified checkpoint, as ``dflash train --resume`` does.
    ``quiet`` keeps the host rank's step lines off stdout. Raises :class:`JobFailed` with the
    earliest rank's one line (a config error a rank found, or where its traceback is), and
    :class:`~dflash.core.signals.Terminated` (or KeyboardInterrupt) when a signal stopped the job
    (its ranks checkpointed): the caller stops the way it would on Ctrl-C."""
    from dflash.pipeline.launch import first_rank_error, launch
    from dflash.pipeline.rank import RANKS_DIR, RunSpec

    run = Path(out)
    run.mkdir(parents=True, exist_ok=True)
    warm_caches(cfg)
    spec = RunSpec(cfg, str(run), resume=resume, wandb=wandb, wait_s=wait_s, pg_timeout_s=pg_timeout_s,
                   check_transfers=check_transfers, quiet=quiet)
    code = launch(spec, report_stop=False)
    if code != 0:
        line, _config_error = first_rank_error(run / RANKS_DIR)
        raise JobFailed(f"the rank job in {run} failed: {line or f'exit status {code}'}")
    summaries = list(read_records(run, "summary"))
    if summaries and (stop := interrupt_for(str(summaries[-1].get("stopped_by", "")))) is not None:
        raise stop  # the job stopped on SIGTERM/Ctrl-C with a checkpoint: so does the caller (dflash demo)
    metrics_path = run / "metrics.json"
    if not summaries or not metrics_path.is_file():
        raise JobFailed(f"the rank job in {run} ended without its summary and metrics.json")
    return JobResult(run, summaries[-1], json.loads(metrics_path.read_text()))


def warm_caches(cfg: DflashConfig) -> None:
    """The converted target (and its tokenizer) built here, once, before any rank starts: ranks then
    only read the cache. With an empty cache every rank building it at once failed a drafter rank
    ("Unrecognized model ... model_type") on 2026-12-05; here it costs one load on a warm cache."""
    import torch

    from dflash.data.model_source import load_causal_lm, load_tokenizer

    load_tokenizer(cfg.target.model)
    load_causal_lm(cfg.target.model, torch.float32)


SPEC_FILE = ".job-spec.pkl"  # a held job's RunSpec, handed to its launcher process


class HeldJob:
    """The rank job of one configuration, alive across its validation blocks (paused between them).

    Its launcher runs in a child process (``python -m dflash.pipeline.trainer``), so the driver can run
    other configurations' blocks meanwhile; ``block.json``/``held.json`` in the run directory carry the
    blocks (:mod:`dflash.pipeline.hold`). The child dies with the driver (SIGTERM: the ranks stop after
    their step with a checkpoint, and a later block resumes it)."""

    def __init__(self, cfg: DflashConfig, out: str | Path, *, resume: bool, first: Any,
                 wait_s: float = 600.0) -> None:
        from dflash.pipeline.hold import HELD_FILE, HOLD_ENV, HOLD_TIMEOUT_S, write_block
        from dflash.pipeline.rank import RunSpec

        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        warm_caches(cfg)
        (self.out / HELD_FILE).unlink(missing_ok=True)
        write_block(self.out, first)
        self.serial = first.serial
        # the other drafter ranks wait in a collective while the host holds: a longer process-group timeout
        spec = RunSpec(cfg, str(self.out), resume=resume, wandb="disabled", wait_s=wait_s,
                       pg_timeout_s=HOLD_TIMEOUT_S + wait_s, quiet=True)
        (self.out / SPEC_FILE).write_bytes(pickle.dumps(spec))
        self.t_start = time.perf_counter()
        self._terminated = False
        self._stderr = open(self.out / ".job.stderr", "w")  # noqa: SIM115 - open while the job runs
        self.proc = subprocess.Popen([sys.executable, "-m", "dflash.pipeline.trainer", str(self.out / SPEC_FILE)],
                                     env={**os.environ, HOLD_ENV: "1"}, stdout=subprocess.DEVNULL,
                                     stderr=self._stderr, preexec_fn=_term_with_parent)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def advance(self, block: Any, timeout: float) -> str:
        """Give the job its next block; wait until it holds after it (``"held"``) or ends (``"ended"``)."""
        from dflash.pipeline.hold import write_block

        if block.serial != self.serial:
            write_block(self.out, block)
            self.serial = block.serial
        return self.wait(timeout)

    def wait(self, timeout: float) -> str:
        from dflash.pipeline.hold import ended, holding

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None or ended(self.out):
                self.proc.wait(timeout)
                self._ended()
                return "ended"
            if holding(self.out, self.serial):
                return "held"
            if time.monotonic() > deadline:
                self.kill()
                raise JobFailed(f"the held job in {self.out} gave no sign of block {self.serial} in {timeout:.0f} s")
            time.sleep(0.05)

    def stop(self, timeout: float) -> None:
        """End the job the normal way (checkpoint, metrics.json, drafter) and wait for it."""
        from dflash.pipeline.hold import Block, write_block

        if self.alive():
            self.serial += 1
            write_block(self.out, Block(self.serial, stop=True))
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise JobFailed(f"the held job in {self.out} did not end within {timeout:.0f} s") from None
        self._ended()

    def terminate(self) -> None:
        """SIGTERM, once: the ranks stop after their step with a checkpoint (a second SIGTERM to the
        launcher would cut its own shutdown short). :meth:`kill` then waits for it."""
        if self.alive() and not self._terminated:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True

    def kill(self) -> None:
        if self.alive():
            self.terminate()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()

    def _ended(self) -> None:
        from dflash.pipeline.launch import first_rank_error
        from dflash.pipeline.rank import RANKS_DIR

        self._stderr.close()
        if self.proc.returncode != 0:
            line, _ = first_rank_error(self.out / RANKS_DIR)
            raise JobFailed(f"the rank job in {self.out} failed: {line or f'exit status {self.proc.returncode}'}")


def _term_with_parent() -> None:
    """In the held job's launcher: SIGTERM when the driver dies (its ranks then stop with a checkpoint)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _main(argv: list[str]) -> int:
    """``python -m dflash.pipeline.trainer SPEC``: launch the pickled RunSpec (a held job's child)."""
    from dflash.pipeline.launch import launch

    return launch(pickle.loads(Path(argv[0]).read_bytes()))


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
