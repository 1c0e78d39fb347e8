"""The held-out quality metric: does a queue setting make a better drafter, measured while it trains.

Why teacher-forced and not real speculative decoding: generation on the CPU runs at about one token
a second, too slow to compare configurations often. One drafter forward over fixed blocks of fixed
sequences is cheap. Each held-out sequence is scored at a window of consecutive anchor positions from
the start of its response (``[train] quality_anchors`` of them). A block's acceptance length is the
serving rule's: 1 + the leading drafted slots equal to the target's greedy token there (the rule of
``dflash.model.acceptance``). Three figures come out:
- ``loss``: the weighted block cross-entropy of those blocks (the training loss, held out);
- ``acceptance``: the mean acceptance length over the window's blocks (every position counts once);
- ``tau``: the serving walk over the window (:func:`serving_walk`). On data the target generated
  greedily it is what ``dflash eval`` measures on those tokens, and it is the one to compare with serving.

The target's side is computed once (hidden states at the captured layers and its greedy token at
every position) and kept; every score after that is one drafter forward in eval mode. Intervals are
bootstrap intervals over sequences (:func:`dflash.core.stats.ratio_bootstrap_ci`): blocks of one
sequence are not independent, sequences are.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
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
def prepare_heldout(model: Any, capture: Any, sequences: Iterable[tuple[int, str, int, torch.Tensor, torch.Tensor]],
                    n_buckets: int, device: torch.device | str, state_dtype: torch.dtype) -> HeldoutStates:
    """The target's side, once: captured states and greedy tokens of every held-out sequence.

    ``sequences``: ``(index, conversation id, bucket, input ids, loss mask)`` each, unpadded. They are
    run one at a time, so no padding enters the states and the full-vocabulary logits of one sequence
    only are ever alive (the greedy tokens need the whole forward; the capture stops at the deepest
    captured layer, as in training, so the states are the training states).
    """
    out = []
    for index, conv_id, bucket, ids, lm in sequences:
        x = ids.view(1, -1).to(device)
        mask = torch.ones_like(x)
        hidden = capture(x, mask).to(state_dtype)[0].to("cpu")
        greedy = model(input_ids=x, attention_mask=mask, use_cache=False).logits[0].argmax(-1).to("cpu")
        out.append(HeldoutSequence(int(index), str(conv_id), int(bucket), hidden, ids.to("cpu").long().view(-1),
                                   lm.to("cpu").bool().view(-1), greedy))
    return HeldoutStates(tuple(out), n_buckets)


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


def window_anchors(seq: HeldoutSequence, block_size: int, n: int) -> torch.Tensor:
    """The sequence's blocks, fixed for the whole run: its first ``n`` response positions ``p`` whose
    whole block lies inside the sequence (``loss_mask[p]`` and ``p <= len - B``), in order from the
    start of the response, where serving's first block stands. Consecutive, so the serving walk
    (:func:`serving_walk`) can be replayed over them.

    Why the scorer has its own rule and does not follow the trainer's (:func:`dflash.model.drafter.anchor_eligible`,
    which also admits blocks that run past the end): the yardstick must not move with the rule being
    judged (issue #36: the two anchor rules were compared with this scorer), and a full block is what
    a serving step drafts. With ``quality_anchors`` well below a response's length the two rules give
    the same window anyway.
    """
    lm = seq.loss_mask.view(-1).bool()
    last = int(lm.numel()) - block_size  # the last position whose block fits
    return torch.nonzero(lm[: max(last + 1, 0)], as_tuple=False).flatten()[:n]


def serving_walk(anchors: Sequence[int], lengths: Sequence[int]) -> tuple[int, int]:
    """``(tokens, blocks)`` of greedy speculative decoding over a window of ``W`` consecutive anchors: the
    first block stands at the window's first anchor, and each block of acceptance length ``L`` moves the
    next one ``L`` tokens on (the target's own token ends it), until ``W`` tokens are out, the last
    block cut to fit: what ``speculative_generate`` does with ``max_new_tokens = W + 1`` (its first
    token comes from the prefill).

    Why this and not the mean over the window's blocks: serving visits a position only if the walk lands
    on it, and it lands more often where the drafter fails (short blocks, more of them). Where failures
    cluster the mean over every position overstates tau: a drafter half way through learning its data
    (tests/test_heldout.py) scored 6.26 as a mean over positions and 4.25 in real speculative decoding.
    On data the target generated greedily, this walk is what serving does on those tokens.
    """
    at = {int(a): int(n) for a, n in zip(anchors, lengths, strict=True)}
    if not at:
        return 0, 0
    pos, tokens, blocks = int(anchors[0]), 0, 0
    end = pos + len(at)  # the window's W tokens after its first anchor, as serving's max_new_tokens = W + 1
    while pos in at and pos < end:
        step = min(at[pos], end - pos)  # the last block is cut at the window's end, as serving cuts it
        tokens += step
        blocks += 1
        pos += step
    return tokens, blocks


# Per held-out sequence: bucket, weighted CE sum, weight sum, acceptance-length sum, blocks, walk tokens, walk blocks.
Row = tuple[int, float, float, float, int, int, int]


@torch.no_grad()
def score_sequences(drafter: Any, states: HeldoutStates, *, anchors: int,
                    device: torch.device | str | None = None) -> list[Row]:
    """Per held-out sequence: ``(bucket, weighted CE sum, weight sum, acceptance-length sum, blocks,
    walk tokens, walk blocks)`` (:func:`serving_walk`).

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
    rows: list[Row] = []
    try:
        seqs = list(states.sequences)
        for i in range(0, len(seqs), SCORE_BATCH):
            rows.extend(_score_batch(drafter, seqs[i:i + SCORE_BATCH], bs, anchors, dev))
    finally:
        drafter.train(was_training)
    return rows


def _score_batch(drafter: Any, seqs: list[HeldoutSequence], bs: int, n_anchors: int, dev: torch.device) -> list[Row]:
    s = max(int(q.input_ids.numel()) for q in seqs)
    b = len(seqs)
    blocks = [window_anchors(q, bs, n_anchors) for q in seqs]
    a = max((int(x.numel()) for x in blocks), default=0)
    if a == 0:
        return [(q.bucket, 0.0, 0.0, 0.0, 0, 0, 0) for q in seqs]
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
        c, lengths = counted[r], accepted[r][valid[r]]
        tokens, walked = serving_walk(blocks[r].tolist(), lengths.tolist())
        out.append((q.bucket, float((ce[r] * w[r])[c].sum()), float(w[r][c].sum()), float(lengths.sum()),
                    int(valid[r].sum()), tokens, walked))
    return out


def summarize(rows: Sequence[Row], n_buckets: int, block_size: int, seed: int = 0) -> dict[str, Any]:
    """The ``heldout`` object of a step record, overall and per bucket, each with its 95% bootstrap
    interval over sequences (None where a bucket has no block): ``loss`` (weighted block CE),
    ``acceptance`` (mean acceptance length of the window's blocks) and ``tau`` (the serving walk over
    the window: tokens per block, what ``dflash eval`` measures on greedy data)."""

    def ratio(num: list[float], den: list[float]) -> tuple[float | None, list[float] | None]:
        ci = ratio_bootstrap_ci(num, den, seed=seed) if num else None
        return (sum(num) / sum(den) if sum(den) > 0 else None), (list(ci) if ci else None)

    def pair(sel: list[Row]) -> dict[str, Any]:
        loss, loss_ci = ratio([r[1] for r in sel], [r[2] for r in sel])
        acc, acc_ci = ratio([r[3] for r in sel], [float(r[4]) for r in sel])
        tau, tau_ci = ratio([float(r[5]) for r in sel], [float(r[6]) for r in sel])
        return {"sequences": len(sel), "blocks": int(sum(r[4] for r in sel)), "loss": loss, "loss_ci": loss_ci,
                "acceptance": acc, "acceptance_ci": acc_ci, "tau": tau, "tau_ci": tau_ci}

    whole = pair(list(rows))
    whole["block_size"] = block_size
    whole["per_bucket"] = [{"bucket": k, **pair([r for r in rows if r[0] == k])} for k in range(n_buckets)]
    return whole


def score_heldout(drafter: Any, states: HeldoutStates, *, anchors: int, seed: int = 0,
                  device: torch.device | str | None = None, keep_rows: bool = False) -> dict[str, Any]:
    """Score the drafter on the held-out set: the ``heldout`` object (:func:`summarize`), under the
    trainer's autocast rule for the device it runs on (:mod:`dflash.core.precision`), so the rank's
    scorer and ``dflash eval`` score alike. ``keep_rows``: the per-sequence rows too, under ``rows``
    (in the order of ``states.sequences``), for a paired comparison over the same sequences."""
    from dflash.core.precision import autocast_on

    dev = torch.device(device) if device is not None else next(drafter.parameters()).device
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast_on(dev.type)):
        rows = score_sequences(drafter, states, anchors=anchors, device=dev)
    out = summarize(rows, states.n_buckets, drafter.spec.block_size, seed=seed)
    if keep_rows:
        out["rows"] = [list(r) for r in rows]
    return out
