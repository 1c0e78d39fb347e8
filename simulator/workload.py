"""Sequence lengths for the simulator, turned into items by the trainer's own sampler.

Three sources (``[workload] lengths``): the configured data set's cached token lengths (needs the
tokenizer once, never again), a lengths or histogram file, or a lognormal distribution. Whatever
the source, items come from :class:`dflash.core.sampler.Sampler`, the same code the trainer uses.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from dflash.core.config import WorkloadConfig
from dflash.core.errors import ConfigError
from dflash.core.sampler import Sampler


def _from_histogram(bins: list, seed: int, n: int) -> list[int]:
    """Draw ``n`` lengths uniformly inside histogram bins weighted by their counts."""
    try:
        rows = [(int(lo), int(hi), float(c)) for lo, hi, c in bins]
    except (TypeError, ValueError):
        raise ConfigError("workload.lengths", 'histogram bins must be [[lo, hi, count], ...]',
                          show_got=False) from None
    if not rows or any(lo < 1 or hi < lo or c < 0 for lo, hi, c in rows) or sum(c for *_, c in rows) <= 0:
        raise ConfigError("workload.lengths", "histogram bins need 1 <= lo <= hi and counts >= 0, sum > 0",
                          show_got=False)
    rng = random.Random(seed)
    weights = [c for *_, c in rows]
    picks = rng.choices(rows, weights=weights, k=n)
    return [rng.randint(lo, hi) for lo, hi, _ in picks]


def load_lengths(workload: WorkloadConfig, model: str = "smollm2", seed: int = 0) -> list[int]:
    """Untruncated sequence lengths from the configured source."""
    src = workload.lengths
    if src == "dataset":
        from dflash.data.lengths import cached_lengths

        return list(cached_lengths(workload, model=model).lengths)
    if src == "lognormal":
        rng = random.Random(seed)
        mu, sigma = math.log(workload.length_median), workload.length_sigma
        return [max(1, round(rng.lognormvariate(mu, sigma))) for _ in range(workload.n_sequences)]
    path = Path(src)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise ConfigError("workload.lengths", "must be a readable JSON lengths or histogram file",
                          src) from None
    if isinstance(data, dict) and "bins" in data:
        return _from_histogram(data["bins"], seed, workload.n_sequences)
    from dflash.data.lengths import load_lengths_file

    return list(load_lengths_file(path).lengths)


def load_lengths_and_prompts(workload: WorkloadConfig, model: str = "smollm2", seed: int = 0
                             ) -> tuple[list[int], list[int] | None]:
    """Lengths plus, for the data set, where each sequence's response starts (anchor counts)."""
    if workload.lengths == "dataset":
        from dflash.data.lengths import cached_lengths

        table = cached_lengths(workload, model=model)
        return list(table.lengths), list(table.prompt_lengths) or None
    return load_lengths(workload, model, seed), None


def make_sampler(workload: WorkloadConfig, model: str = "smollm2", seed: int = 0,
                 block_size: int | None = None, heldout_per_bucket: int = 0) -> Sampler:
    """The trainer's sampler on the cached lengths; with ``block_size`` (``cfg.drafter.block_size``) it
    drops the anchor-less sequences the trainer drops, and with ``heldout_per_bucket``
    (:func:`dflash.core.sampler.heldout_per_bucket`) it holds out the sequences the trainer's quality
    metric scores, so simulated items are the trainer's items."""
    lengths, prompts = load_lengths_and_prompts(workload, model, seed)
    return Sampler(lengths, workload, seed=seed, prompt_lengths=prompts, block_size=block_size,
                   heldout_per_bucket=heldout_per_bucket)
