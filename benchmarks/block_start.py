"""What a validation block's start costs, read from a finished validation (issue #26 item 2).

Run: python benchmarks/block_start.py VALIDATION_DIR   (e.g. dflash-demo/validation)

Per configuration and block: the block's wall time as the driver saw it (``wall_s`` in the block
row), split into the job's start-up (process start and model load: the wall time before the
coordinator's clock began), the refill (from the block's first record to the moment the queue held
``min_ready`` items, where its measurement starts) and the measured training. A block of a held job
(``held``) pays neither start-up nor refill; a restarted block (GPUs, or a job resumed after its
driver died) pays both, and replays the items that were in flight.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dflash.core.records import read_records


def block_costs(val: Path) -> list[dict]:
    payload = json.loads((val / "validation.json").read_text())
    out = []
    for row in payload["block_rows"]:
        run = val / "runs" / row["name"]
        measured = (row["t_end"] - row["t_start"]) if row.get("t_start") is not None else None
        refill, start_up = 0.0, None
        if measured is not None and row["block"] == 0:  # the coordinator's clock starts after the model load
            refill = row["t_start"] - min(float(p["t_start"]) for p in read_records(run, "produce"))
            start_up = row["wall_s"] - row["t_end"]  # process start, model load (and the block's checkpoint)
        elif measured is not None:
            start_up = row["wall_s"] - measured  # a held block: the hand-over (checkpoint, held.json, unpause)
        out.append({"config": row["name"], "block": row["block"], "held": row.get("held"),
                    "wall_s": row.get("wall_s"), "start_up_s": start_up, "refill_s": refill,
                    "measured_s": measured, "takes": row.get("takes")})
    return out


def main() -> None:
    val = Path(sys.argv[1] if len(sys.argv) > 1 else "dflash-demo/validation")
    print("| config | block | held | wall s | start-up / hand-over s | refill s | measured s | takes |")
    print("|---|---|---|---|---|---|---|---|")
    for r in block_costs(val):
        def f(x: float | None) -> str:
            return "-" if x is None else f"{x:.1f}"

        print(f"| {r['config']} | {r['block']} | {r['held']} | {f(r['wall_s'])} | {f(r['start_up_s'])} | "
              f"{f(r['refill_s'])} | {f(r['measured_s'])} | {r['takes']} |")


if __name__ == "__main__":
    main()
