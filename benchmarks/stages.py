"""Shared by the long benchmarks: run one stage as a command, its output appended to a log."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def sh(cmd: list[str], log: Path) -> None:
    """Run ``cmd`` with stdout/stderr appended to ``log``; print its time; stop the benchmark on failure."""
    t0 = time.perf_counter()
    print("$ " + " ".join(cmd), flush=True)
    with log.open("a") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    print(f"  ({time.perf_counter() - t0:.0f} s, rc {rc}; log {log})", flush=True)
    if rc != 0:
        sys.exit(f"failed: {' '.join(cmd)} (log {log})")
