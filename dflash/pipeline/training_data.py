"""The training data of a run: conversations, their lengths and the sampler over them.

Every rank forms an item from its id alone, so every rank builds this from the config: target ranks
encode the item's sequences for the forward, drafter ranks re-form its tokens to check a transfer,
and ``validate`` and ``eval`` map trained item ids back to conversations (kept out of held-out
prompts). Encodings are cached per sequence (a producer forms each item once; a replayed item again).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from dflash.core.config import DflashConfig
from dflash.core.sampler import sampler_for


class TrainingData:
    """Conversations, their lengths and the sampler over them; encodes sequences on demand."""

    def __init__(self, cfg: DflashConfig, tokenizer: Any, conversations: list[Any] | None = None) -> None:
        from dflash.data.conversations import load_conversations, resolve_dataset

        w = cfg.workload
        if conversations is None:
            path = resolve_dataset(w.dataset, cfg.target.model)
            # Every rank (and every block's job) reads the file: the command that started them has said
            # what it holds (damaged records included) once, so a rank says nothing (load_conversations
            # never prints).
            conversations, _ = load_conversations(path, w.sample, w.max_conversations)
        self.conversations = conversations
        self.tokenizer = tokenizer
        self.max_len = w.max_len
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()
        lengths, prompts = self._encoded_lengths() if len(conversations) <= 2000 else self._cached_lengths(cfg)
        # Sequences without an eligible anchor are dropped by the sampler (trained nothing, cost a forward).
        self.sampler = sampler_for(cfg, lengths, prompts)

    def _encoded_lengths(self) -> tuple[list[int], list[int]]:
        """Lengths (truncated) and tokens before the first anchor position (the first of two consecutive
        response tokens: :func:`dflash.model.drafter.anchor_eligible`), from the encodings themselves, so
        the sampler's drop rule is exact here."""
        lengths, prompts = [], []
        for i in range(len(self.conversations)):
            ids, mask = self.encode(i)
            hits = torch.nonzero(mask[:-1] & mask[1:], as_tuple=False)
            lengths.append(int(ids.numel()))
            prompts.append(int(hits[0]) if hits.numel() else int(ids.numel()))
        return lengths, prompts

    def _cached_lengths(self, cfg: DflashConfig) -> tuple[list[int], list[int] | None]:
        """Untruncated lengths and prompt lengths from the length cache (the same tokenisation, no re-encoding)."""
        from dflash.data.lengths import cached_lengths

        table = cached_lengths(cfg.workload, model=cfg.target.model)
        ids = [c.id for c in self.conversations]
        if list(table.ids) != ids:
            raise RuntimeError("the length cache does not match the data set's conversations")
        return list(table.lengths), list(table.prompt_lengths) or None

    def encode(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        from dflash.model.target import encode_conversation

        with self._lock:
            hit = self._cache.get(index)
        if hit is None:
            hit = encode_conversation(self.tokenizer, self.conversations[index], self.max_len)
            with self._lock:
                self._cache[index] = hit
        return hit
