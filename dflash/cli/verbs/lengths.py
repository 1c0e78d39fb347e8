"""``dflash lengths``: Tokenise (or read the cache of) the configured data set; print its size and bucket shares."""

from __future__ import annotations

import argparse

from dflash.cli.options import Verb
from dflash.core.config import DflashConfig


def handle(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """Tokenise (or read the cache of) the configured data set; print its size and bucket shares."""
    from dflash.core.sampler import bucket_of
    from dflash.data.dataset_choice import pin_dataset
    from dflash.data.lengths import cached_lengths

    said: list[str] = []
    cfg = pin_dataset(cfg, say=said.append)  # "auto" resolved once (the length cache keys on that file)
    w = cfg.workload
    table = cached_lengths(w, model=cfg.target.model)
    print(*said)  # the data line, once the data proved usable (bad input stays one line)
    counts = [0] * len(w.bucket_bounds)
    for n in table.lengths:
        counts[bucket_of(n, w.bucket_bounds)] += 1
    total = len(table)
    longer = sum(n > w.max_len for n in table.lengths)
    print(f"length table: {total} sequences, {sum(table.lengths)} tokens untruncated "
          f"(dataset {w.dataset}, sample {w.sample}, tokenizer {cfg.target.model}, key {table.key})")
    print(f"records read: {table.stats.describe()}")
    print(f"bucket shares of sequences (max_len {w.max_len}; {longer} longer, truncated into the last):")
    lo = 0
    for hi, c in zip(w.bucket_bounds, counts, strict=True):
        share = 100.0 * c / total if total else 0.0
        print(f"  ({lo}, {hi}]".ljust(16) + f"{share:6.1f}%  {c}")
        lo = hi
    from dflash.core.sampler import sampler_for

    sampler = sampler_for(cfg, table.lengths, table.prompt_lengths)
    mix = " / ".join(f"{100 * m:.1f}" for m in sampler.item_mix())
    per_item = f"{w.seqs_per_item} seqs" if w.seqs_per_item else f"{w.tokens_per_item} tokens"
    if sampler.dropped_no_anchor:
        print(f"{sampler.dropped_no_anchor} sequences dropped: no two consecutive response tokens within "
              f"max_len {w.max_len} (no anchor; the trainer and the simulator drop them too)")
    print(f"item mix p ({per_item} per item, {sampler.items_per_epoch()} items per epoch): {mix} %")
    return 0


VERB = Verb("tokenise the configured data set; print the cached length table and bucket shares")
