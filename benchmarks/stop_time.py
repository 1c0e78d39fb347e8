"""How long a clean stop takes: SIGTERM to ``dflash train`` after a few steps, timed until it exits.

A scheduler's grace period (Slurm's ``--signal=TERM@SECONDS`` lead time or ``KillWait``, Kubernetes'
``terminationGracePeriodSeconds``) must cover it: the step in flight, the checkpoint, the launcher's
shutdown (docs/guide/operations.md). Prints one JSON line: exit status, stop seconds, steps, median
step seconds, checkpoint bytes.

    python benchmarks/stop_time.py --config dflash/profiles/cpu-smollm2.toml --out /tmp/stop-run
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "dflash" / "profiles" / "cpu-smollm2.toml"))
    ap.add_argument("--out", required=True, help="run directory (replaced)")
    ap.add_argument("--steps-before", type=int, default=6, help="steps recorded before the SIGTERM")
    a = ap.parse_args()
    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "dflash", "train", "--config", a.config, "--out", str(out), "--max-steps", "100000",
           "--wandb", "disabled"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    steps = out / "step.jsonl"
    while proc.poll() is None and (not steps.is_file() or steps.read_text().count("\n") < a.steps_before):
        time.sleep(0.2)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate()
    stop_s = time.monotonic() - t0
    ts = [json.loads(x)["t"] for x in steps.read_text().splitlines()]
    gaps = sorted(b - a for a, b in itertools.pairwise(ts))
    ckpt = sum(f.stat().st_size for f in out.rglob("*") if f.is_file() and "checkpoint" in str(f.relative_to(out)))
    print(json.dumps({"exit": proc.returncode, "stop_s": round(stop_s, 2), "steps": len(ts),
                      "median_step_s": round(gaps[len(gaps) // 2], 2) if gaps else None, "checkpoint_bytes": ckpt,
                      "said": stdout.strip().splitlines()[-1:]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
