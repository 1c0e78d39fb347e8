"""Which conversations a run trained on: the one home for mapping a run's taken items to conversations.

Held-out evaluation (``dflash eval``, validation's final tau, the learning-curve benchmark) must skip
every conversation a run trained on. A run's take records name its items (``"epoch:bucket:k"``); the
run's sampler (:func:`dflash.core.sampler.sampler_for`, built from the length cache, the same lengths
the trainer's sampler is built from once clipped to ``max_len``) forms each item again from its id,
and the length cache's ids name the conversations. Nothing else is read: no tokenizer, no encoding
of the data set, no model (the whole training data set is never loaded to learn this).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from dflash.core.config import DflashConfig


def trained_conversation_ids(run_dir: Path, cfg: DflashConfig) -> set[str]:
    """Conversation ids of every item a run's take records show (to keep evaluation held out)."""
    from dflash.core.records import read_records

    return conversation_ids_of((i for r in read_records(run_dir, "take") for i in r["item_ids"]), cfg)


def conversation_ids_of(item_ids: Iterable[str], cfg: DflashConfig) -> set[str]:
    """Conversation ids of the sequences that formed these items under ``cfg``'s sampler."""
    from dflash.core.sampler import sampler_for
    from dflash.data.lengths import cached_lengths

    items = list(item_ids)
    if not items:
        return set()
    table = cached_lengths(cfg.workload, model=cfg.target.model, progress=False)
    sampler = sampler_for(cfg, table.lengths, table.prompt_lengths)
    return {table.ids[k] for k in sampler.sequences_of(items)}
