"""The data sampler: which sequences form which target micro-batch (item), in which order.

Torch-free and deterministic under a seed, so the trainer and the simulator see the same item
stream from the same token lengths. Items are formed inside one length bucket (by real, unpadded
length) and each has a stable id ``"epoch:bucket:k"`` from which :meth:`Sampler.item` forms it
again: that is how a resumed run re-produces the items that were in flight at a kill.

Orders: ``random`` (a full shuffle of the epoch's items), ``length_grouped`` (HF-style: shuffle,
cut into mega-batches, sort each by length, longest first: the source of "sawtooth" arrivals), and
``sorted`` (ascending length over the whole epoch, the worst case).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache

from dflash.core.config import DflashConfig, WorkloadConfig
from dflash.core.errors import ConfigError

# Epoch orders kept formed: workers read the current epoch and (at resume, replay) a few earlier ones.
# More only costs memory: a simulated week of training walks hundreds of epochs (benchmarks/sim_memory.py).
EPOCH_CACHE = 16


def has_anchor(length: int, prompt_length: int, max_len: int) -> bool:
    """Whether a sequence has an eligible anchor under the drafter's rule (the training reference's:
    ``loss_mask[p]`` and ``loss_mask[p + 1]``, :func:`dflash.model.drafter.anchor_eligible`) once
    truncated at ``max_len``. The block size does not enter: a block may run past the end.

    The response tokens start at ``prompt_length`` (the tokens before the first non-empty response,
    :func:`dflash.data.lengths.prompt_token_lengths`), and such a response has at least two tokens
    (its content and its end-of-turn token), so the earliest pair decides: one exists inside the
    truncated sequence iff ``prompt_length + 1 < min(length, max_len)``. A sequence without one would
    cost a target forward and train nothing.
    """
    return prompt_length + 2 <= min(length, max_len)


def bucket_of(length: int, bounds: Sequence[int]) -> int:
    """Index of the first upper bound >= length (lengths above the last bound are clipped to it)."""
    return bisect.bisect_left(bounds, min(length, bounds[-1]))


@dataclass(frozen=True, slots=True)
class ItemSpec:
    """One item before the target runs: its sequences and shape."""

    item_id: str
    bucket: int
    seq_indices: tuple[int, ...]
    real_tokens: int
    padded_len: int
    n_seqs: int


def parse_item_id(item_id: str) -> tuple[int, int, int]:
    """``"epoch:bucket:k"`` -> (epoch, bucket, k); ValueError on anything else."""
    parts = item_id.split(":")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a sampler item id: {item_id!r}")
    e, b, k = (int(p) for p in parts)
    return e, b, k


class Sampler:
    """Forms and orders items over token lengths; one epoch at a time, forever.

    ``lengths`` are real token counts per sequence; they are clipped to ``workload.max_len``. With
    ``prompt_lengths`` and the drafter's ``block_size`` (the drafter is known; the rule does not depend
    on its value), sequences with no eligible anchor (:func:`has_anchor`) are left out of every item and
    counted in ``dropped_no_anchor``: the trainer and the simulator, given the same lengths, drop the
    same sequences.
    """

    def __init__(self, lengths: Sequence[int], workload: WorkloadConfig, seed: int = 0,
                 prompt_lengths: Sequence[int] | None = None, block_size: int | None = None,
                 heldout_per_bucket: int = 0, heldout_seed: int | None = None) -> None:
        if not lengths:
            raise ValueError("the sampler needs at least one sequence length")
        if any(int(n) < 1 for n in lengths):
            raise ValueError("sequence lengths must be >= 1")
        self.workload = workload
        self.seed = seed
        self.heldout_seed = seed if heldout_seed is None else heldout_seed
        self.bounds = workload.bucket_bounds
        self.n_buckets = len(self.bounds)
        self.lengths = [min(int(n), workload.max_len) for n in lengths]
        # Tokens before each sequence's first response token (None: unknown); only the simulator's
        # anchor counts use them.
        self.prompt_lengths = [int(n) for n in prompt_lengths] if prompt_lengths else None
        self.seq_bucket = [bucket_of(n, self.bounds) for n in self.lengths]
        keep = [True] * len(self.lengths)
        if self.prompt_lengths is not None and block_size is not None:
            keep = [has_anchor(n, p, workload.max_len)
                    for n, p in zip(self.lengths, self.prompt_lengths, strict=True)]
            if not any(keep):
                raise ConfigError("workload.max_len", "no sequence has an anchor position (two consecutive "
                                  "response tokens within max_len): a larger max_len or other data is needed",
                                  workload.max_len)
        self.dropped_no_anchor = keep.count(False)
        eligible = [[i for i, b in enumerate(self.seq_bucket) if b == bk and keep[i]] for bk in range(self.n_buckets)]
        self.heldout = self._hold_out(eligible, heldout_per_bucket)
        held = {i for per in self.heldout for i in per}
        self._by_bucket = [[i for i in per if i not in held] for per in eligible]
        # Epochs are formed once and kept: a sweep runs many simulations over one sampler.
        self._epoch = lru_cache(maxsize=EPOCH_CACHE)(self._form_epoch)
        self._by_id = lru_cache(maxsize=EPOCH_CACHE)(lambda e: {it.item_id: it for it in self._epoch(e)})

    def _hold_out(self, eligible: list[list[int]], per_bucket: int) -> tuple[tuple[int, ...], ...]:
        """Per bucket, up to ``per_bucket`` sequences (never more than half the bucket, so training keeps
        most of it) drawn with a generator of the held-out seed alone (the run's seed unless
        ``[train] quality_seed`` is set): every configuration and every training seed of one validation
        holds out the same sequences, and a held-out sequence is in no item of any epoch."""
        if per_bucket <= 0:
            return tuple(() for _ in eligible)
        rng = random.Random(self.heldout_seed * 1_000_003 + 424_242)
        out = []
        for seqs in eligible:
            n = min(per_bucket, len(seqs) // 2)
            out.append(tuple(sorted(rng.sample(seqs, n))) if n else ())
        return tuple(out)

    # ---------------------------------------------------------------- formation
    def _rng(self, epoch: int, salt: int) -> random.Random:
        return random.Random((self.seed * 1_000_003 + epoch) * 7 + salt)

    def _chunks(self, seqs: list[int]) -> list[list[int]]:
        w = self.workload
        if w.seqs_per_item is not None:
            n = w.seqs_per_item
            return [seqs[i:i + n] for i in range(0, len(seqs), n)]
        budget = w.tokens_per_item
        assert budget is not None
        chunks: list[list[int]] = []
        cur: list[int] = []
        longest = 0
        for s in seqs:
            ln = self.lengths[s]
            if cur and max(longest, ln) * (len(cur) + 1) > budget:
                chunks.append(cur)
                cur, longest = [], 0
            cur.append(s)
            longest = max(longest, ln)
        if cur:
            chunks.append(cur)
        return chunks

    def _form_epoch(self, epoch: int) -> tuple[ItemSpec, ...]:
        """All items of one epoch, formed per bucket from a per-epoch shuffle, then ordered."""
        form_rng = self._rng(epoch, 1)
        items: list[ItemSpec] = []
        for b, seqs in enumerate(self._by_bucket):
            seqs = list(seqs)
            form_rng.shuffle(seqs)
            for k, chunk in enumerate(self._chunks(seqs)):
                lens = [self.lengths[s] for s in chunk]
                items.append(ItemSpec(f"{epoch}:{b}:{k}", b, tuple(chunk), sum(lens), max(lens), len(chunk)))
        return tuple(self._order(items, self._rng(epoch, 2)))

    def _order(self, items: list[ItemSpec], rng: random.Random) -> list[ItemSpec]:
        order = self.workload.order
        if order == "sorted":
            return sorted(items, key=lambda it: (it.padded_len, it.item_id))
        rng.shuffle(items)
        if order == "random":
            return items
        m = self.workload.mega_batch
        out: list[ItemSpec] = []
        for i in range(0, len(items), m):
            out.extend(sorted(items[i:i + m], key=lambda it: -it.padded_len))
        return out

    # ---------------------------------------------------------------- access
    def epoch(self, epoch: int) -> tuple[ItemSpec, ...]:
        """The ordered items of one epoch (cached: resume and replay re-form them cheaply)."""
        if epoch < 0:
            raise ValueError("epoch must be >= 0")
        return self._epoch(epoch)

    def item(self, item_id: str) -> ItemSpec:
        """Form an item again from its id alone."""
        e, _, k = parse_item_id(item_id)
        if e < 0:
            raise ValueError("epoch must be >= 0")
        it = self._by_id(e).get(item_id)
        if it is None:
            raise KeyError(f"no item {item_id!r} in epoch {e} (k={k})")
        return it

    def sequences_of(self, item_ids: Iterable[str]) -> set[int]:
        """Indices of the sequences that formed these items (e.g. to keep evaluation held out)."""
        return {k for i in item_ids for k in self.item(i).seq_indices}

    def iter_items(self, start_epoch: int = 0, start_index: int = 0) -> Iterator[ItemSpec]:
        """Items in order from a position (the checkpointed sampler position), epoch after epoch."""
        e, i = start_epoch, start_index
        while True:
            items = self.epoch(e)
            while i < len(items):
                yield items[i]
                i += 1
            e, i = e + 1, 0

    def items_per_epoch(self) -> int:
        return len(self.epoch(0))

    def item_mix(self) -> list[float]:
        """The item mix ``p``: the bucket distribution of one epoch's items."""
        counts = [0] * self.n_buckets
        for it in self.epoch(0):
            counts[it.bucket] += 1
        total = sum(counts)
        return [c / total for c in counts]

    def sequence_shares(self) -> list[float]:
        """Share of sequences (not items) per bucket: what docs/REFERENCE.md's measured shares describe."""
        counts = [len(s) for s in self._by_bucket]
        total = sum(counts)
        return [c / total for c in counts]


def sampler_for(cfg: DflashConfig, lengths: Sequence[int], prompt_lengths: Sequence[int] | None) -> Sampler:
    """The run's sampler: the one home for how a run forms its items, so that the trainer, the
    simulator and every reader of a run's item ids (held-out evaluation) form the same items from the
    same lengths, dropping the same anchor-less sequences (``cfg.drafter.block_size``) and holding out
    the same sequences for the quality metric (``[train] quality_every``)."""
    return Sampler(lengths, cfg.workload, seed=cfg.seed, prompt_lengths=prompt_lengths or None,
                   block_size=cfg.drafter.block_size, heldout_per_bucket=heldout_per_bucket(cfg),
                   heldout_seed=cfg.train.quality_seed)


def heldout_per_bucket(cfg: DflashConfig) -> int:
    """Sequences held out per bucket for the quality metric: ``[train] quality_per_bucket`` when
    ``quality_every`` is set, else none."""
    return cfg.train.quality_per_bucket if cfg.train.quality_every is not None else 0
