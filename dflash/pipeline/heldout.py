"""The held-out metric in the rank job (``[train] quality_every``; the metric itself: dflash.model.heldout).

One name: the metric, its records (``heldout`` in step records, ``dflash eval --json`` and W&B), and the
code that computes it are *held-out*; only the published config keys that schedule it keep the word
quality (``quality_every``, ``quality_per_bucket``, ``quality_anchors``).

Who does what, and why:
- The sampler (every rank forms it from the config) holds the sequences out of every item, so no rank
  trains on them and every configuration of one seed holds out the same ones.
- The first target rank runs the target over them once, before it produces, and keeps the states and
  greedy tokens in ``RUN/heldout/states.pt``: the target already sits on its device there, and a
  drafter rank holds only a CPU copy. A resume (or a job whose file matches) reuses the file; a
  validation computes it once for all its configurations and seeds (:func:`publish_states`,
  :func:`adopt_states`: one copy, linked into each run directory before its job starts).
- The host drafter rank loads that file at its first score and keeps it; every ``quality_every`` steps it
  scores the drafter (one forward, no generation) into the step record under ``heldout``. The other
  drafter ranks wait for it in the next stop agreement, as for ``eval_every``. Each score's
  per-sequence rows go to ``RUN/heldout/rows.jsonl`` (one line per scored step), for the paired
  comparison of configurations over the same sequences (:mod:`tuning.validation.paired`).
``RUN/heldout.json`` names the held-out conversations (ids, indices per bucket, seed, sizes) and
whether this job computed the target's states or found them kept (``states``), and how long that
took (``states_s``: what a validation saves per job that finds them kept).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash.pipeline.context import Corpus, RankContext

if TYPE_CHECKING:
    from dflash.core.config import DflashConfig
    from dflash.model.drafter import DFlashDrafter
    from dflash.model.heldout import HeldoutStates
    from dflash.model.target import HiddenStateCapture
    from dflash.pipeline.telemetry import WandbLogger
    from dflash.pipeline.training_data import TrainingData

HELDOUT_JSON = "heldout.json"
STATES_FILE = Path("heldout") / "states.pt"
ROWS_FILE = Path("heldout") / "rows.jsonl"


def heldout_description(cfg: DflashConfig, corpus: Corpus) -> dict[str, Any]:
    """What ``heldout.json`` says: which conversations, by bucket, chosen how."""
    per_bucket = [list(b) for b in corpus.sampler.heldout]
    ids = [str(corpus.data.conversations[i].id) for b in per_bucket for i in b]
    t = cfg.train
    return {"ids": ids, "per_bucket": per_bucket, "seed": heldout_seed(cfg), "quality_per_bucket": t.quality_per_bucket,
            "anchors": t.quality_anchors, "block_size": cfg.drafter.block_size,
            "model": cfg.target.model, "layer_ids": list(corpus.layer_ids)}


def heldout_seed(cfg: DflashConfig) -> int:
    """The seed the held-out set is drawn with (``[train] quality_seed``, else the run's)."""
    return cfg.seed if cfg.train.quality_seed is None else cfg.train.quality_seed


def ensure_states(path: Path, per_bucket: Sequence[Sequence[int]], model: str, layer_ids: Sequence[int], *,
                  data: Callable[[], TrainingData], target_model: Any, capture: HiddenStateCapture,
                  device: torch.device, state_dtype: torch.dtype, keep: bool,
                  status: Callable[[str], None] = lambda _m: None) -> tuple[HeldoutStates, str]:
    """The held-out set's target states, from the one place both users get them (the first target rank
    before it produces, with ``keep``; ``dflash eval`` for a run, without): the file at ``path`` when its
    fingerprint (sequences, model, captured layers) matches, else computed from ``data()`` now (and
    written to ``path`` when ``keep``). Returns the states and ``"kept"`` or ``"computed"``."""
    from dflash.model.heldout import load_heldout, prepare_heldout, save_heldout

    fp = _fingerprint(per_bucket, model, layer_ids)
    states = load_heldout(path, fp) if path.exists() else None
    if states is not None:
        return states, "kept"
    status("computing the held-out set's target states")
    t0 = time.perf_counter()
    states = prepare_heldout(target_model, capture, heldout_sequences(data(), per_bucket), len(per_bucket), device,
                             state_dtype)
    if keep:
        save_heldout(path, states, fp)
    status(f"held-out states: {len(states.sequences)} sequences in {time.perf_counter() - t0:.1f} s")
    return states, "computed"


def _fingerprint(per_bucket: Sequence[Sequence[int]], model: str, layer_ids: Sequence[int]) -> str:
    from dflash.model.heldout import heldout_fingerprint

    return heldout_fingerprint([i for b in per_bucket for i in b], model, list(layer_ids))


def states_fingerprint(cfg: DflashConfig, corpus: Corpus) -> str:
    """The fingerprint of a rank job's held-out states (what :func:`ensure_states` checks)."""
    return _fingerprint(corpus.sampler.heldout, cfg.target.model, corpus.layer_ids)


def prepare_on_target(ctx: RankContext, corpus: Corpus, capture: HiddenStateCapture, state_dtype: torch.dtype) -> None:
    """First target rank, before producing: the held-out states, unless the run already keeps them."""
    cfg = ctx.cfg
    if cfg.train.quality_every is None or ctx.roles.rank != 0:
        return
    t0 = time.perf_counter()
    _, how = ensure_states(ctx.out / STATES_FILE, corpus.sampler.heldout, cfg.target.model, corpus.layer_ids,
                           data=lambda: corpus.data, target_model=corpus.target.model, capture=capture,
                           device=ctx.device, state_dtype=state_dtype, keep=True, status=ctx.status)
    (ctx.out / HELDOUT_JSON).write_text(json.dumps({**heldout_description(cfg, corpus), "states": how,
                                                    "states_s": round(time.perf_counter() - t0, 3)}, indent=1))


def publish_states(run_dir: Path, shared: Path) -> bool:
    """Make ``run_dir``'s kept states the validation's one copy at ``shared`` if there is none yet
    (a hard link, else a copy, put in place by an atomic rename: a reader never sees half a file).
    True when ``shared`` exists afterwards."""
    src = run_dir / STATES_FILE
    if shared.exists() or not src.exists():
        return shared.exists()
    _place(src, shared)
    return True


def adopt_states(shared: Path, run_dir: Path) -> bool:
    """Before a job starts in ``run_dir``: link the validation's one copy of the held-out states in as
    the run's own, so its target rank finds them kept (:func:`ensure_states` reuses them only if the
    fingerprint matches: another held-out set, model or layers computes its own). True if linked."""
    dst = run_dir / STATES_FILE
    if not shared.exists() or dst.exists():
        return False
    _place(shared, dst)
    return True


def _place(src: Path, dst: Path) -> None:
    import shutil

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:  # another file system, or no hard links there
        shutil.copyfile(src, tmp)
    tmp.replace(dst)


def append_rows(run_dir: Path, step: int, ids: Sequence[str], rows: Sequence[Sequence[float]]) -> None:
    """One scored step's per-sequence rows (:data:`dflash.model.heldout.Row`), in the order of ``ids``."""
    path = run_dir / ROWS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps({"step": int(step), "ids": list(ids), "rows": [list(r) for r in rows]}) + "\n")


def read_rows(run_dir: Path) -> dict[int, dict[str, Any]]:
    """A run's per-sequence rows by step (the last line of a step wins: a resumed run may score it again;
    a torn last line, from a killed job, is skipped)."""
    out: dict[int, dict[str, Any]] = {}
    try:
        lines = (run_dir / ROWS_FILE).read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            d = json.loads(line)
            out[int(d["step"])] = {"ids": list(d["ids"]), "rows": [list(r) for r in d["rows"]]}
        except (ValueError, KeyError, TypeError):
            continue
    return out


def heldout_sequences(data: Any, per_bucket: Any) -> Iterator[tuple[int, str, int, torch.Tensor, torch.Tensor]]:
    """The held-out sequences of the run's data as the target encodes them for training."""
    for bucket, indices in enumerate(per_bucket):
        for index in indices:
            ids, lm = data.encode(index)
            yield index, str(data.conversations[index].id), bucket, ids, lm


class HeldoutScorer:
    """Host drafter rank: scores the drafter on the kept held-out states every ``quality_every`` steps."""

    def __init__(self, ctx: RankContext, corpus: Corpus, drafter: DFlashDrafter) -> None:
        self.ctx, self.corpus, self.drafter, self.wait_s = ctx, corpus, drafter, ctx.wait_s
        self.every = ctx.cfg.train.quality_every
        self.states: Any = None

    def due(self, step: int) -> bool:
        return self.every is not None and (step + 1) % self.every == 0

    def _states(self) -> Any:
        from dflash.model.heldout import load_heldout

        if self.states is None:
            path, fp = self.ctx.out / STATES_FILE, states_fingerprint(self.ctx.cfg, self.corpus)
            deadline = time.perf_counter() + self.wait_s
            while (got := load_heldout(path, fp)) is None:  # the target rank writes it before producing
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"train.quality_every: the held-out states ({path}) did not appear within "
                                       f"{self.wait_s:.0f} s")
                time.sleep(0.2)
            self.states = got
        return self.states

    def score(self, step: int, wb: WandbLogger | None) -> dict[str, Any]:
        from dflash.model.heldout import score_heldout

        ctx = self.ctx
        t0 = time.perf_counter()
        states = self._states()
        res = score_heldout(self.drafter, states, anchors=ctx.cfg.train.quality_anchors, seed=ctx.cfg.seed,
                            device=ctx.device, keep_rows=True)  # seed: the intervals' bootstrap
        append_rows(ctx.out, step, states.ids, res.pop("rows"))
        res["score_s"] = time.perf_counter() - t0
        if wb is not None:
            wb.log({"heldout/loss": res["loss"], "heldout/acceptance": res["acceptance"], "heldout/tau": res["tau"],
                    **{f"heldout/acceptance/bucket_{b['bucket']}": b["acceptance"] for b in res["per_bucket"]
                       if b["acceptance"] is not None}}, step=step)
        ctx.progress(f"held-out after step {step + 1}: {heldout_line(res)}")
        return res


def _ci(v: Any) -> str:
    return f"[{v[0]:.3f}, {v[1]:.3f}]" if v else "[n/a]"


def heldout_line(h: dict[str, Any]) -> str:
    """One line of a ``heldout`` object: acceptance and loss with intervals, acceptance per bucket."""
    if h.get("acceptance") is None:
        return "no held-out block"
    per = " ".join(f"{b['acceptance']:.3f}" if b["acceptance"] is not None else "n/a" for b in h["per_bucket"])
    return (f"tau {h['tau']:.3f} {_ci(h.get('tau_ci'))}  acceptance {h['acceptance']:.3f} "
            f"{_ci(h.get('acceptance_ci'))}  loss {h['loss']:.4f} "
            f"{_ci(h.get('loss_ci'))}  per bucket [{per}]  ({h['sequences']} sequences, {h['blocks']} blocks)")

