"""Issue 34's hot path on the CPU: the host-planned loss equals the device path, and a drafter step reads
the device at most once (the sync counter), and stage timers read their events a step later."""

from __future__ import annotations

import torch

from dflash.model.hostsync import HostMasks, counting, spans
from tests.test_drafter import make, rand_batch


def test_spans_round_trip_masks_with_several_runs():
    m = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    assert spans(m) == (((1, 3), (4, 5)), ((0, 6),), ())
    h = HostMasks.of(m.long(), m)
    assert torch.equal(h.loss_mask(), m) and h.lengths.tolist() == [3, 6, 0]


def test_host_planned_loss_equals_the_device_path_without_a_device_read():
    """Same anchors, rows, loss, weight, counts and gradients; the planned path never calls ``to_host``."""
    target, drafter = make(block_size=4, layers=1, anchors=5)
    ids, am, lm, ctx = rand_batch(target, [30, 17, 23], resp_from=3)
    lm[1, 8:10] = False  # a second response span in one row

    def run(**kw):
        drafter.zero_grad()
        out = drafter.loss(ctx, ids, lm, am, generator=torch.Generator().manual_seed(3), **kw)
        out.loss_sum.backward()
        return out, [p.grad.clone() for p in drafter.trainable_parameters()]

    ref, g_ref = run()
    with counting() as n:
        got, g_got = run(host=HostMasks.of(am, lm))
    assert n.n == 0
    assert (got.tokens, got.anchors, got.context_seen) == (ref.tokens, ref.anchors, ref.context_seen)
    assert got.tokens > 0 and got.weight_sum == ref.weight_sum and int(got.correct) == ref.correct
    torch.testing.assert_close(got.loss_sum, ref.loss_sum, rtol=0, atol=0)
    for a, b in zip(g_ref, g_got, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
