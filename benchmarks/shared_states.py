"""What one copy of the held-out target states per validation saves (issue #36 item 2).

Every job of a validation with ``[train] quality_every`` needs the target's states and greedy tokens
of the held-out set. Without sharing each job's first target rank computes them (one full target
forward per held-out sequence); with sharing the first job computes them and every other job (each
configuration, each training seed) gets the validation's copy linked in and only loads it. Both
paths are the real ones (``ensure_states``, ``publish_states``, ``adopt_states`` of
:mod:`dflash.pipeline.heldout`), timed side by side on the packaged SmolLM2 target and data with the
CPU profile's buckets, one thread (a rank's share of 2 cores).

    python benchmarks/shared_states.py                     # 16 per bucket, 3 configurations x 2 seeds
    python benchmarks/shared_states.py --per-bucket 4 --configs 3 --seeds 1
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-bucket", type=int, default=16, help="held-out sequences per bucket (>= 1)")
    ap.add_argument("--configs", type=int, default=3, help="configurations in the validation (>= 1)")
    ap.add_argument("--seeds", type=int, default=2, help="training seeds per configuration (>= 1)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (>= 1)")
    args = ap.parse_args(argv)
    for name in ("per_bucket", "configs", "seeds", "threads"):
        if getattr(args, name) < 1:
            ap.exit(2, f"shared_states.py: error: --{name.replace('_', '-')} must be >= 1\n")

    import torch

    from benchmarks.heldout_cost import cpu_heldout_setup
    from dflash.model.target import HiddenStateCapture
    from dflash.pipeline.heldout import STATES_FILE, adopt_states, ensure_states, publish_states

    cfg, target, layer_ids, data, held = cpu_heldout_setup(args.per_bucket, args.threads)
    capture = HiddenStateCapture(target.model, layer_ids)

    def job(run: Path) -> tuple[str, float]:
        """One job's first target rank: the states, kept or computed (the rank job's own call)."""
        t0 = time.perf_counter()
        _, how = ensure_states(run / STATES_FILE, held, cfg.target.model, layer_ids, data=lambda: data,
                               target_model=target.model, capture=capture, device=torch.device("cpu"),
                               state_dtype=torch.float32, keep=True)
        return how, time.perf_counter() - t0

    jobs = args.configs * args.seeds
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        how, compute_s = job(out / "runs" / "job0")  # the first job computes (with or without sharing alike)
        assert how == "computed"
        t0 = time.perf_counter()
        publish_states(out / "runs" / "job0", out / STATES_FILE)
        adopt_states(out / STATES_FILE, out / "runs" / "job1")
        how, _ = job(out / "runs" / "job1")
        reuse_s = time.perf_counter() - t0  # publish, link and load: what a second job pays
        assert how == "kept"
    n = sum(len(b) for b in held)
    saved = (jobs - 1) * (compute_s - reuse_s)
    print(f"shared-states: {n} held-out sequences ({[len(b) for b in held]} per bucket); computed by a job "
          f"{compute_s:.1f} s, reused by a job {reuse_s:.2f} s (link + load); a validation of {args.configs} "
          f"configurations x {args.seeds} seeds ({jobs} jobs) computes once: {jobs * compute_s:.1f} s -> "
          f"{compute_s + (jobs - 1) * reuse_s:.1f} s, saving {saved:.1f} s; {args.threads} thread(s); `python "
          f"benchmarks/shared_states.py --per-bucket {args.per_bucket} --configs {args.configs} --seeds {args.seeds}`")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
