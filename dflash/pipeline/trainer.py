"""Training from a library call: the rank job ``dflash train`` launches, started and read back.

dflash has one training loop, the rank job (:mod:`dflash.pipeline.launch`: one process per rank, so
1 + 1 is two processes, with the coordinator, the transport, the control channel and the ledger).
Validation blocks, the demo's calibration run, benchmarks and tests start it through :func:`train`,
so what they measure is what a user's ``dflash train`` runs. There is no in-process twin to keep in
step with it (issue #26: the in-process ``Trainer``/``HSQueue`` measured one process model and the
recommendation was applied on another).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.core.config import DflashConfig
from dflash.core.records import read_records


class JobFailed(RuntimeError):
    """A rank failed; the message is the earliest rank's one line (its traceback is in ``RUN/.ranks``)."""


@dataclass(frozen=True)
class JobResult:
    out: Path
    summary: dict[str, Any]  # the run's last summary record (DESIGN.md's counts)
    metrics: dict[str, Any]  # metrics.json, written by the host rank at the end


def train(cfg: DflashConfig, out: str | Path, *, resume: bool = False, quiet: bool = True,
          wandb: str = "disabled", wait_s: float = 600.0, pg_timeout_s: float = 600.0,
          check_transfers: bool = False) -> JobResult:
    """Run the rank job to its end (``cfg``'s limits) in ``out`` and return what it wrote.

    ``resume`` continues the run's newest verified checkpoint, as ``dflash train --resume`` does.
    ``quiet`` keeps the host rank's step lines off stdout. Raises :class:`JobFailed` with the
    earliest rank's one line (a config error a rank found, or where its traceback is)."""
    from dflash.pipeline.launch import first_rank_error, launch
    from dflash.pipeline.rank import RANKS_DIR, RunSpec

    run = Path(out)
    run.mkdir(parents=True, exist_ok=True)
    spec = RunSpec(cfg, str(run), resume=resume, wandb=wandb, wait_s=wait_s, pg_timeout_s=pg_timeout_s,
                   check_transfers=check_transfers, quiet=quiet)
    code = launch(spec)
    if code != 0:
        line, _config_error = first_rank_error(run / RANKS_DIR)
        raise JobFailed(f"the rank job in {run} failed: {line or f'exit status {code}'}")
    summaries = list(read_records(run, "summary"))
    metrics_path = run / "metrics.json"
    if not summaries or not metrics_path.is_file():
        raise JobFailed(f"the rank job in {run} ended without its summary and metrics.json")
    return JobResult(run, summaries[-1], json.loads(metrics_path.read_text()))
