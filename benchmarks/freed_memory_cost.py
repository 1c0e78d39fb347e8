"""What returning freed memory costs a CPU target forward (``DFLASH_RETURN_FREED_MEMORY``, issue #33).

``hostmem.return_freed_memory`` fixes glibc's mmap threshold at 256 KiB so a CPU rank's peak follows what
its step holds (the memory model can then be held against it). Each large block is then faulted in again
on every use. This prints the process CPU seconds per SmolLM2 capture forward (layers 1, 8, 14, 20, 27;
340 random tokens; one thread; 12 forwards after one warm-up) with glibc's default and with the threshold
fixed, alternated in fresh processes, and their ratio::

    python benchmarks/freed_memory_cost.py --repeat 2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

CHILD = """
import resource, sys
if sys.argv[1] == "fixed":
    from dflash.pipeline.hostmem import return_freed_memory
    assert return_freed_memory()
import torch
torch.set_num_threads(1)
from dflash.model.target import HiddenStateCapture, load_target
cap = HiddenStateCapture(load_target("smollm2").model, [1, 8, 14, 20, 27])
ids = torch.randint(0, 40000, (1, 340), generator=torch.Generator().manual_seed(0))
cap(ids)
r0 = resource.getrusage(resource.RUSAGE_SELF)
for _ in range(12):
    cap(ids)
r1 = resource.getrusage(resource.RUSAGE_SELF)
print((r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / 12, r1.ru_minflt - r0.ru_minflt)
"""


def one(mode: str) -> tuple[float, int]:
    env = {**os.environ, "DFLASH_RETURN_FREED_MEMORY": "1" if mode == "fixed" else "0"}
    out = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, check=True, capture_output=True, text=True)
    cpu, faults = out.stdout.split()
    return float(cpu), int(faults)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2, help="alternated pairs (default 2)")
    n = ap.parse_args().repeat
    rows = {"default": [], "fixed": []}
    for _ in range(n):
        for mode in ("default", "fixed"):
            rows[mode].append(one(mode))
    for mode, r in rows.items():
        print(f"{mode:>8}: CPU s per forward {', '.join(f'{c:.3f}' for c, _ in r)}; minor faults per 12 forwards "
              f"{', '.join(str(f) for _, f in r)}")
    mean = {m: sum(c for c, _ in r) / len(r) for m, r in rows.items()}
    print(f"fixed / default: {mean['fixed'] / mean['default']:.2f}x CPU time per forward")


if __name__ == "__main__":
    main()
