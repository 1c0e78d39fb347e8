"""The held-out quality metric: does a queue setting make a better drafter, measured while it trains.

Why teacher-forced and not real speculative decoding: generation on the CPU runs at about one token
a second, too slow to compare configurations often. One drafter forward over fixed blocks of fixed
sequences is cheap, and on data the target regenerated greedily it follows serving closely: the
context of a block is then exactly what the target would have produced, so a block's acceptance
length here is the one a serving engine would see at that position (1 + the leading drafted slots
that equal the target's greedy token, the rule ``dflash.model.acceptance`` applies).

The target's side is computed once (hidden states at the captured layers and its greedy token at
every position) and kept; every score after that is one drafter forward in eval mode. Intervals are
bootstrap intervals over sequences (:func:`dflash.core.stats.ratio_bootstrap_ci`): blocks of one
sequence are not independent, sequences are.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dflash.core.stats import ratio_bootstrap_ci

SCORE_BATCH = 4  # held-out sequences per drafter forward (one bucket's sequences have similar lengths)
HEAD_ROWS = 2048  # rows per LM-head chunk: the [rows, vocab] logits of one chunk only are alive


@dataclass(frozen=True)
class HeldoutSequence:
    """One held-out sequence as the target saw it, unpadded, on the CPU until scored."""

    index: int  # the sequence's index in the run's data
    conversation_id: str
    bucket: int
    hidden: torch.Tensor  # [S, K*d] captured states, in the training state dtype
    input_ids: torch.Tensor  # [S]
    loss_mask: torch.Tensor  # [S] bool
    greedy: torch.Tensor  # [S] the target's argmax next token after each position (greedy[p] predicts p + 1)


@dataclass(frozen=True)
class HeldoutStates:
    sequences: tuple[HeldoutSequence, ...]
    n_buckets: int

    @property
    def ids(self) -> list[str]:
        return [s.conversation_id for s in self.sequences]


def heldout_fingerprint(indices: Sequence[int], model: str, layer_ids: Sequence[int]) -> str:
    """What the kept states depend on: a resume or another configuration reuses them only if it matches."""
    return hashlib.sha1(f"{list(indices)}|{model}|{list(layer_ids)}".encode()).hexdigest()[:16]


@torch.no_grad()
def prepare_heldout(target: Any, capture: Any, data: Any, per_bucket: Sequence[Sequence[int]],
                    device: torch.device | str, state_dtype: torch.dtype) -> HeldoutStates:
    """The target's side, once: captured states and greedy tokens of every held-out sequence.

    ``per_bucket``: the sampler's held-out sequence indices per bucket. Sequences are run one at a
    time, so no padding enters the states and the full-vocabulary logits of one sequence only are
    ever alive (the greedy tokens need the whole forward, the capture stops at the deepest layer).
    """
    out = []
    for bucket, indices in enumerate(per_bucket):
        for index in indices:
            ids, lm = data.encode(index)
            x = ids.view(1, -1).to(device)
            mask = torch.ones_like(x)
            hidden = capture(x, mask).to(state_dtype)[0].to("cpu")
            logits = target.model(input_ids=x, attention_mask=mask, use_cache=False).logits
            greedy = logits[0].argmax(-1).to("cpu")
            out.append(HeldoutSequence(int(index), str(data.conversations[index].id), bucket, hidden,
                                       ids.to("cpu").long(), lm.to("cpu").bool(), greedy))
    return HeldoutStates(tuple(out), len(per_bucket))


def save_heldout(path: Path, states: HeldoutStates, fingerprint: str) -> None:
    """Atomically (a reader polls for the file: it must never see half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"fingerprint": fingerprint, "n_buckets": states.n_buckets,
                "sequences": [s.__dict__ for s in states.sequences]}, tmp)
    tmp.replace(path)


def load_heldout(path: Path, fingerprint: str | None = None) -> HeldoutStates | None:
    """The kept states, or None when there are none for ``fingerprint`` (other sequences, model or layers)."""
    if not path.exists():
        return None
    blob = torch.load(path, map_location="cpu", weights_only=True)
    if fingerprint is not None and blob.get("fingerprint") != fingerprint:
        return None
    return HeldoutStates(tuple(HeldoutSequence(**d) for d in blob["sequences"]), int(blob["n_buckets"]))


def fixed_anchors(seq: HeldoutSequence, block_size: int, n: int, seed: int) -> torch.Tensor:
    """The sequence's blocks, fixed for the whole run: up to ``n`` eligible positions (a response token
    with the block inside the sequence, the training rule) drawn with a generator of (seed, id)."""
    from dflash.model.drafter import sample_anchors

    digest = hashlib.sha1(f"{seed}/heldout/{seq.conversation_id}/{seq.index}".encode()).hexdigest()
    gen = torch.Generator().manual_seed(int(digest[:15], 16))
    anchors, valid = sample_anchors(seq.loss_mask.view(1, -1), block_size, n, gen)
    return anchors[0][valid[0]]


@dataclass
class _Tally:
    """Per sequence: (weighted CE sum, weight sum) and (acceptance-length sum, blocks)."""

    loss: list[tuple[float, float]]
    acc: list[tuple[float, float]]


@torch.no_grad()
def score_sequences(drafter: Any, states: HeldoutStates, *, anchors: int, seed: int = 0,
                    device: torch.device | str | None = None) -> list[tuple[int, float, float, float, int]]:
    """Per held-out sequence: ``(bucket, weighted CE sum, weight sum, acceptance-length sum, blocks)``.

    Slot ``k`` of a block at ``a`` predicts the token at ``a + k``; its loss counts where training
    counts it (a response token), with the slot weight ``w_k``, against the data's token. Its
    acceptance compares the drafter's argmax with the target's greedy token at ``a + k``
    (``greedy[a + k - 1]``); the block's acceptance length is 1 + the leading slots that agree.
    """
    dev = torch.device(device) if device is not None else next(drafter.parameters()).device
    spec = drafter.spec
    bs = spec.block_size
    was_training = drafter.training
    drafter.eval()
    rows: list[tuple[int, float, float, float, int]] = []
    try:
        seqs = list(states.sequences)
        for i in range(0, len(seqs), SCORE_BATCH):
            rows.extend(_score_batch(drafter, seqs[i:i + SCORE_BATCH], bs, anchors, seed, dev))
    finally:
        drafter.train(was_training)
    return rows


def _score_batch(drafter: Any, seqs: list[HeldoutSequence], bs: int, n_anchors: int, seed: int,
                 dev: torch.device) -> list[tuple[int, float, float, float, int]]:
    s = max(int(q.input_ids.numel()) for q in seqs)
    b = len(seqs)
    blocks = [fixed_anchors(q, bs, n_anchors, seed) for q in seqs]
    a = max((int(x.numel()) for x in blocks), default=0)
    if a == 0:
        return [(q.bucket, 0.0, 0.0, 0.0, 0) for q in seqs]
    hidden = torch.zeros((b, s, seqs[0].hidden.shape[-1]), dtype=seqs[0].hidden.dtype)
    ids = torch.zeros((b, s), dtype=torch.long)
    lm = torch.zeros((b, s), dtype=torch.bool)
    greedy = torch.zeros((b, s), dtype=torch.long)
    ctx = torch.zeros((b, s), dtype=torch.bool)
    anchors = torch.zeros((b, a), dtype=torch.long)
    valid = torch.zeros((b, a), dtype=torch.bool)
    for r, (q, x) in enumerate(zip(seqs, blocks, strict=True)):
        n = int(q.input_ids.numel())
        hidden[r, :n], ids[r, :n], lm[r, :n], greedy[r, :n], ctx[r, :n] = q.hidden, q.input_ids, q.loss_mask, \
            q.greedy, True
        anchors[r, : x.numel()], valid[r, : x.numel()] = x, True
    hidden, ids, lm, greedy, ctx, anchors, valid = (t.to(dev) for t in (hidden, ids, lm, greedy, ctx, anchors, valid))

    h = drafter.block_hidden(hidden, ids.gather(1, anchors), anchors, ctx)  # [b, A, B, d]
    tpos = (anchors[:, :, None] + torch.arange(bs, device=dev)).clamp(max=s - 1)  # blocks fit: a <= len - B
    flat = tpos.view(b, -1)
    tgt = ids.gather(1, flat).view(b, a, bs)
    want = greedy.gather(1, (flat - 1).clamp(min=0)).view(b, a, bs)
    counted = lm.gather(1, flat).view(b, a, bs) & valid[:, :, None]
    counted[:, :, 0] = False
    rows = h.view(-1, h.shape[-1])
    pred = torch.empty(rows.shape[0], dtype=torch.long, device=dev)
    ce = torch.empty(rows.shape[0], dtype=torch.float32, device=dev)
    for j in range(0, rows.shape[0], HEAD_ROWS):
        logits = drafter.logits(rows[j:j + HEAD_ROWS]).float()
        pred[j:j + HEAD_ROWS] = logits.argmax(-1)
        ce[j:j + HEAD_ROWS] = F.cross_entropy(logits, tgt.view(-1)[j:j + HEAD_ROWS], reduction="none")
    pred, ce = pred.view(b, a, bs), ce.view(b, a, bs)
    w = drafter.spec.slot_weights(dev, torch.float32).view(1, 1, bs).expand(b, a, bs)
    agree = (pred == want)[:, :, 1:]
    accepted = agree.long().cumprod(-1).sum(-1) + 1  # [b, A]: 1 + the leading agreeing slots
    out = []
    for r, q in enumerate(seqs):
        c = counted[r]
        out.append((q.bucket, float((ce[r] * w[r])[c].sum()), float(w[r][c].sum()),
                    float(accepted[r][valid[r]].sum()), int(valid[r].sum())))
    return out


def summarize(rows: Sequence[tuple[int, float, float, float, int]], n_buckets: int, block_size: int,
              seed: int = 0) -> dict[str, Any]:
    """The ``heldout`` object of a step record: loss and acceptance overall and per bucket, with 95%
    bootstrap intervals over sequences (None where a bucket has no block)."""

    def pair(sel: list[tuple[int, float, float, float, int]]) -> dict[str, Any]:
        loss_n, loss_d = [r[1] for r in sel], [r[2] for r in sel]
        acc_n, acc_d = [r[3] for r in sel], [float(r[4]) for r in sel]
        loss = sum(loss_n) / sum(loss_d) if sum(loss_d) > 0 else None
        acc = sum(acc_n) / sum(acc_d) if sum(acc_d) > 0 else None
        loss_ci = ratio_bootstrap_ci(loss_n, loss_d, seed=seed) if sel else None
        acc_ci = ratio_bootstrap_ci(acc_n, acc_d, seed=seed) if sel else None
        return {"sequences": len(sel), "blocks": int(sum(acc_d)), "loss": loss,
                "loss_ci": list(loss_ci) if loss_ci else None, "acceptance": acc,
                "acceptance_ci": list(acc_ci) if acc_ci else None}

    whole = pair(list(rows))
    whole["block_size"] = block_size
    whole["per_bucket"] = [{"bucket": k, **pair([r for r in rows if r[0] == k])} for k in range(n_buckets)]
    return whole


def score_heldout(drafter: Any, states: HeldoutStates, *, anchors: int, seed: int = 0,
                  device: torch.device | str | None = None) -> dict[str, Any]:
    """Score the drafter on the held-out set: the ``heldout`` object (:func:`summarize`)."""
    rows = score_sequences(drafter, states, anchors=anchors, seed=seed, device=device)
    return summarize(rows, states.n_buckets, drafter.spec.block_size, seed=seed)
