"""The held-out quality metric in the rank job (``[train] quality_every``; the metric: dflash.model.heldout).

Who does what, and why:
- The sampler (every rank forms it from the config) holds the sequences out of every item, so no rank
  trains on them and every configuration of one seed holds out the same ones.
- The first target rank runs the target over them once, before it produces, and keeps the states and
  greedy tokens in ``RUN/heldout/states.pt``: the target already sits on its device there, and a
  drafter rank holds only a CPU copy. A resume (or a job whose file matches) reuses the file.
- The host drafter rank loads that file at its first score and keeps it; every ``quality_every`` steps it
  scores the drafter (one forward, no generation) into the step record under ``heldout``. The other
  drafter ranks wait for it in the next stop agreement, as for ``eval_every``.
``RUN/heldout.json`` names the held-out conversations (ids, indices per bucket, seed, sizes).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

HELDOUT_JSON = "heldout.json"
STATES_FILE = Path("heldout") / "states.pt"


def heldout_description(rr: Any) -> dict[str, Any]:
    """What ``heldout.json`` says: which conversations, by bucket, chosen how."""
    per_bucket = [list(b) for b in rr.sampler.heldout]
    ids = [str(rr.data.conversations[i].id) for b in per_bucket for i in b]
    t = rr.cfg.train
    return {"ids": ids, "per_bucket": per_bucket, "seed": rr.cfg.seed, "quality_per_bucket": t.quality_per_bucket,
            "anchors": t.quality_anchors, "block_size": rr.cfg.drafter.block_size,
            "model": rr.cfg.target.model, "layer_ids": list(rr.layer_ids)}


def _fingerprint(rr: Any) -> str:
    from dflash.model.heldout import heldout_fingerprint

    return heldout_fingerprint([i for b in rr.sampler.heldout for i in b], rr.cfg.target.model, rr.layer_ids)


def prepare_on_target(rr: Any) -> None:
    """First target rank, before producing: the held-out states, unless the run already keeps them."""
    from dflash.model.heldout import load_heldout, prepare_heldout, save_heldout

    if rr.cfg.train.quality_every is None or rr.roles.rank != 0:
        return
    path, fp = rr.out / STATES_FILE, _fingerprint(rr)
    (rr.out / HELDOUT_JSON).write_text(json.dumps(heldout_description(rr), indent=1))
    if path.exists() and load_heldout(path, fp) is not None:
        return
    rr.status("computing the held-out set's target states")
    t0 = time.perf_counter()
    states = prepare_heldout(rr.target.model, rr.capture, heldout_sequences(rr.data, rr.sampler.heldout),
                             len(rr.sampler.heldout), rr.device, rr.state_dtype)
    save_heldout(path, states, fp)
    rr.status(f"held-out states: {len(states.sequences)} sequences in {time.perf_counter() - t0:.1f} s")


def heldout_sequences(data: Any, per_bucket: Any) -> Iterator[tuple[int, str, int, torch.Tensor, torch.Tensor]]:
    """The held-out sequences of the run's data as the target encodes them for training."""
    for bucket, indices in enumerate(per_bucket):
        for index in indices:
            ids, lm = data.encode(index)
            yield index, str(data.conversations[index].id), bucket, ids, lm


class QualityScorer:
    """Host drafter rank: scores the drafter on the kept held-out states every ``quality_every`` steps."""

    def __init__(self, rr: Any, wait_s: float) -> None:
        self.rr, self.wait_s = rr, wait_s
        self.every = rr.cfg.train.quality_every
        self.states: Any = None

    def due(self, step: int) -> bool:
        return self.every is not None and (step + 1) % self.every == 0

    def _states(self) -> Any:
        from dflash.model.heldout import load_heldout

        if self.states is None:
            path, fp = self.rr.out / STATES_FILE, _fingerprint(self.rr)
            deadline = time.perf_counter() + self.wait_s
            while (got := load_heldout(path, fp)) is None:  # the target rank writes it before producing
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"train.quality_every: the held-out states ({path}) did not appear within "
                                       f"{self.wait_s:.0f} s")
                time.sleep(0.2)
            self.states = got
        return self.states

    def score(self, step: int, wb: Any) -> dict[str, Any]:
        from dflash.model.heldout import score_heldout

        rr = self.rr
        t0 = time.perf_counter()
        res = score_heldout(rr.drafter, self._states(), anchors=rr.cfg.train.quality_anchors, seed=rr.cfg.seed,
                            device=rr.device)  # seed: the intervals' bootstrap
        res["score_s"] = time.perf_counter() - t0
        if wb is not None:
            wb.log({"heldout/loss": res["loss"], "heldout/acceptance": res["acceptance"], "heldout/tau": res["tau"],
                    **{f"heldout/acceptance/bucket_{b['bucket']}": b["acceptance"] for b in res["per_bucket"]
                       if b["acceptance"] is not None}}, step=step)
        rr.progress(f"held-out after step {step + 1}: {quality_line(res)}")
        return res


def _ci(v: Any) -> str:
    return f"[{v[0]:.3f}, {v[1]:.3f}]" if v else "[n/a]"


def quality_line(h: dict[str, Any]) -> str:
    """One line of a ``heldout`` object: acceptance and loss with intervals, acceptance per bucket."""
    if h.get("acceptance") is None:
        return "no held-out block"
    per = " ".join(f"{b['acceptance']:.3f}" if b["acceptance"] is not None else "n/a" for b in h["per_bucket"])
    return (f"tau {h['tau']:.3f} {_ci(h.get('tau_ci'))}  acceptance {h['acceptance']:.3f} "
            f"{_ci(h.get('acceptance_ci'))}  loss {h['loss']:.4f} "
            f"{_ci(h.get('loss_ci'))}  per bucket [{per}]  ({h['sequences']} sequences, {h['blocks']} blocks)")
