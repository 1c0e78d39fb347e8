"""The drafter's LM head and weighted cross-entropy over counted rows, a chunk of rows at a time.

Why: the loss's rows are anchors x (block - 1) per sequence (7,680 for one sequence at 512 anchors
and block 16) and the target's vocabulary is up to ~152k, so the ``[rows, vocab]`` logits the
unchunked loss materialises (in the head's dtype, a float32 copy, the log-softmax and its
gradient) are 13.5 GB for that one sequence and 122 GiB for an 8-sequence item: more than the rest
of the drafter together (docs/REFERENCE.md, "Drafter loss memory at large vocabularies").

How: :class:`ChunkedLinearCrossEntropy` runs the head and the cross-entropy on at most
``chunk_rows`` rows at a time and, when the rows need a gradient, computes that gradient in the same
pass (``(softmax - onehot) * w @ W``, Liger Kernel's fused linear-cross-entropy scheme), so no
chunk's logits outlive its iteration and nothing has to be recomputed in the backward: the
backward only scales the kept ``[rows, d]`` gradient by the incoming scalar. The peak is one chunk's
``[chunk, vocab]`` logits, whatever the row count. The head is the target's and frozen, so no weight
gradient is formed (a head that requires one is refused rather than silently left untrained).

Numerics follow the unchunked loss exactly: the head runs in its own dtype (and under the caller's
autocast, as ``nn.Linear`` would), the cross-entropy in at least float32, the weights per row are the
caller's. Equality with ``F.cross_entropy`` over full logits is tested in float32 and float64
(tests/test_chunked_loss.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_ROWS = 512  # SpecForge chunks by 128 anchor blocks; 512 rows x 152k x 4 B = 0.3 GB per tensor


def _chunk_pass(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                w: torch.Tensor, want_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk: (sum of w * CE, number of argmax hits, gradient of that sum wrt ``hidden`` or None)."""
    logits = F.linear(hidden.to(weight.dtype), weight, bias)
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))  # CE in >= float32
    rows = torch.arange(wide.shape[0], device=wide.device)
    picked = wide[rows, target]
    correct = (wide.argmax(-1) == target).sum()
    lse = torch.logsumexp(wide, dim=-1)
    loss = ((lse - picked) * w.to(wide.dtype)).sum()
    if not want_grad:
        return loss, correct, None
    # ``wide`` is this chunk's own buffer (``logits`` itself when the head is already >= float32):
    # the softmax and its gradient overwrite it, so a chunk holds one or two [chunk, vocab] buffers.
    prob = wide.sub_(lse[:, None]).exp_()
    prob[rows, target] -= 1.0
    prob.mul_(w.to(prob.dtype)[:, None])
    del logits, wide
    grad = prob.to(weight.dtype) @ weight  # same path as autograd through .to() and nn.Linear
    return loss, correct, grad.to(hidden.dtype)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``sum_i w_i * CE(hidden_i @ W^T + b, target_i)`` with the logits formed ``chunk_rows`` at a time.

    Returns ``(loss_sum, correct)``: the weighted sum (a scalar in >= float32, differentiable wrt
    ``hidden``) and the count of rows whose argmax is the target (no gradient).
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,  # type: ignore[override]
                target: torch.Tensor, w: torch.Tensor, chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        want_grad = bool(ctx.needs_input_grad[0])
        n = hidden.shape[0]
        out_dtype = torch.promote_types(
            torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type)
            else weight.dtype, torch.float32)
        loss = torch.zeros((), dtype=out_dtype, device=hidden.device)
        correct = torch.zeros((), dtype=torch.long, device=hidden.device)
        grad = torch.empty_like(hidden) if want_grad else None
        for lo in range(0, n, chunk_rows):
            hi = min(lo + chunk_rows, n)
            part, hits, g = _chunk_pass(hidden[lo:hi], weight, bias, target[lo:hi], w[lo:hi], want_grad)
            loss += part.to(out_dtype)
            correct += hits
            if grad is not None:
                grad[lo:hi] = g
        if grad is not None:
            ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_correct: torch.Tensor | None  # type: ignore[override]
                 ) -> tuple[torch.Tensor | None, None, None, None, None, None]:
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None, None


def chunked_linear_cross_entropy(hidden: torch.Tensor, head: torch.nn.Module, target: torch.Tensor,
                                 weights: torch.Tensor, chunk_rows: int = DEFAULT_CHUNK_ROWS
                                 ) -> tuple[torch.Tensor, int]:
    """``(sum of weights * CE, argmax hits)`` of ``head(hidden)`` against ``target``, ``[rows]`` each.

    ``head`` is an ``nn.Linear``-like module with a frozen ``weight`` ``[vocab, d]`` (and optional
    ``bias``): the target's LM head. ``chunk_rows`` >= 1 bounds the logits held at once.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    weight = head.weight
    bias = getattr(head, "bias", None)
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("the chunked loss forms no gradient for the LM head: freeze it (the drafter's head is the"
                         " target's, frozen)")
    loss, correct = ChunkedLinearCrossEntropy.apply(hidden, weight, bias, target, weights, int(chunk_rows))
    return loss, int(correct)


__all__ = ["DEFAULT_CHUNK_ROWS", "ChunkedLinearCrossEntropy", "chunked_linear_cross_entropy"]
