"""The drafter's training loss planned on the host: no device read between the receive and the backward.

Why (issue 34 item 2): :meth:`DFlashDrafter.loss` on device masks reads the device four times per item
(the loss mask for the anchor draw, the anchor and context counts, the boolean index of the counted
slots, the weight sum) and the chunked loss a fifth (its hit count). Each read stalls the host until the
device is idle. Here the host plans the step from :class:`~dflash.model.hostsync.HostMasks` (the masks
as the producer saw them, sent in the item's metadata): it draws the anchors with the same
:func:`~dflash.model.drafter.sample_anchors` (so the anchors, the rows and their order are the device
path's), counts anchors, context and counted slots, sums the weights, and hands the device integer
indices instead of a boolean mask. The result equals the device path's; only ``correct`` stays a 0-d
device tensor (folded into the step's one stats read).
"""

from __future__ import annotations

from typing import Any

import torch

from dflash.model.chunked_ce import ChunkedLinearCrossEntropy
from dflash.model.drafter import DraftLoss, _context_seen, sample_anchors
from dflash.model.hostsync import HostMasks, to_device


def planned_loss(drafter: Any, context_states: torch.Tensor, input_ids: torch.Tensor, host: HostMasks,
                 generator: torch.Generator | None) -> Any:
    """:meth:`DFlashDrafter.loss` of a batch (``drafter``: a :class:`~dflash.model.drafter.DFlashDrafter`), with
    every count computed on the host."""
    spec = drafter.spec
    bs = spec.block_size
    b, s = input_ids.shape
    if host.width != s or len(host.real) != b:
        raise ValueError(f"the item's host masks are {len(host.real)} x {host.width}, its tokens {b} x {s}")
    dev = input_ids.device
    lm_h, am_h = host.loss_mask(), host.attention_mask()
    anchors_h, valid_h = sample_anchors(lm_h, bs, spec.anchors, generator, host.lengths)
    n_anchor = int(valid_h.sum())
    if anchors_h.shape[1] == 0 or n_anchor == 0:
        zero = sum(p.sum() for p in drafter.trainable_parameters()) * 0.0
        return DraftLoss(zero.float(), 0, 0.0, 0, 0)
    seen = int(_context_seen(anchors_h, valid_h, am_h))
    tpos = anchors_h[:, :, None] + torch.arange(bs)  # [b, A, B]
    tpos_c = tpos.clamp(max=s - 1)
    counted = (tpos < s) & lm_h.gather(1, tpos_c.view(b, -1)).view(b, -1, bs) & valid_h[:, :, None]
    counted[:, :, 0] = False
    idx_h = torch.nonzero(counted.flatten()).flatten()
    head_dtype = torch.promote_types(drafter.lm_head.weight.dtype, torch.float32)
    w_h = spec.slot_weights("cpu", head_dtype).expand_as(counted)[counted]

    anchors, tpos_d, idx = (to_device(t, dev) for t in (anchors_h, tpos_c, idx_h))
    valid_ctx = to_device(am_h, dev)
    hidden = drafter.block_hidden(context_states, input_ids.gather(1, anchors), anchors, valid_ctx)
    if idx_h.numel() == 0:
        zero = hidden.sum() * 0.0
        return DraftLoss(zero.float(), 0, 0.0, n_anchor, 0, seen)
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, idx)
    tgt = input_ids.gather(1, tpos_d.view(b, -1)).reshape(-1).index_select(0, idx)
    head = drafter.lm_head
    loss_sum, correct = ChunkedLinearCrossEntropy.apply(rows, head.weight, getattr(head, "bias", None), tgt,
                                                       to_device(w_h, dev), int(spec.loss_chunk_rows))
    return DraftLoss(loss_sum=loss_sum, tokens=int(idx_h.numel()), weight_sum=float(w_h.sum()),
                     anchors=n_anchor, correct=correct, context_seen=seen)


__all__ = ["planned_loss"]
