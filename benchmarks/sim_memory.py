"""Cost per simulated hour and peak memory at 4, 32 and 128 simulated hours, side by side.

Run: python benchmarks/sim_memory.py [--hours 4 32 128] [--config FILE]
Each length runs ``dflash simulate --json`` in a fresh process (the drafter-bound H200 example by
default) that reports its own CPU time and peak resident memory; a 60-simulated-second run of the
same process measures start-up (imports, lengths, the sampler's first epochs), which is taken off
the cost. Goals (issue #18): cost per simulated hour flat within 20% and peak memory flat within
1.5x from 4 to 128 hours (memory used to grow linearly: 122 MB at 4 h, 655 MB at 32 h).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "h200-8b-drafter-bound.toml"
# The child's peak is its own image's VmHWM, as benchmarks/loss_memory.py reads it: not ``ru_maxrss``,
# which Linux carries across exec from the forked parent (a child of a large process read the parent's size).
CHILD = """
import io, json, resource, sys, contextlib
from dflash.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    rc = main(sys.argv[1:])
u = resource.getrusage(resource.RUSAGE_SELF)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"rc": rc, "cpu_s": u.ru_utime + u.ru_stime, "peak_mb": hwm / 1024}))
"""


def run(config: Path, sim_seconds: float, out: Path) -> dict[str, float]:
    cmd = [sys.executable, "-c", CHILD, "simulate", "--config", str(config), "--sim-seconds", str(sim_seconds),
           "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    res = json.loads(done.stdout.strip().splitlines()[-1])
    assert res["rc"] == 0, done.stderr
    res["items"] = json.loads(out.read_text())["summary"]["produced"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, nargs="+", default=[4.0, 32.0, 128.0])
    ap.add_argument("--config", type=Path, default=EXAMPLE)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = run(args.config, 60.0, Path(tmp) / "start.json")
        rows = [(h, run(args.config, h * 3600.0, Path(tmp) / f"{h}.json")) for h in args.hours]
    print(f"{args.config.name}: start-up (60 simulated s) {base['cpu_s']:.2f} s CPU, peak {base['peak_mb']:.0f} MB")
    print(f"  {'hours':>6} {'items':>9} {'CPU s':>8} {'s per sim-hour':>15} {'peak MB':>8}")
    costs, peaks = [], []
    for h, r in rows:
        cost = (r["cpu_s"] - base["cpu_s"]) / (h - 60 / 3600)
        costs.append(cost)
        peaks.append(r["peak_mb"])
        print(f"  {h:>6g} {r['items']:>9,} {r['cpu_s']:>8.1f} {cost:>15.3f} {r['peak_mb']:>8.0f}")
    print(f"  cost per simulated hour, largest / smallest: {max(costs) / min(costs):.2f}x (goal <= 1.20x)")
    print(f"  peak memory, largest / smallest: {max(peaks) / min(peaks):.2f}x (goal <= 1.5x)")


if __name__ == "__main__":
    main()
