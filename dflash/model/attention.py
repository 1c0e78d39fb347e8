"""The draft layers' attention: one mask rule, two ways to apply it (dense reference, flex block mask).

What the mask says (docs/ARCHITECTURE.md, "Drafter attention"): the slots of the block anchored at
``a_j`` see context position ``p`` iff ``p < a_j`` (and ``p`` is a real token), and the ``B`` slots of
their own block in both directions; nothing of any other block.

Why two paths:

* ``dense`` (the reference, and the fallback): :func:`block_attention_mask` builds the boolean mask
  ``[b, 1, A*B, S + A*B]`` and SDPA applies it, with k/v repeated per query head for grouped-query
  attention. It runs everywhere, CPU training included. On a GPU a boolean mask rules out the
  FlashAttention kernels: the memory-efficient kernel turns it into an additive bias kept for the
  backward (``A*B x (S + A*B)`` per sequence and layer: about 1.3 GB per layer on the 8B example), and
  ``repeat_interleave`` copies k and v ``heads / kv_heads`` times.
* ``flex``: the same rule as a ``mask_mod`` for ``torch.nn.attention.flex_attention`` (torch >= 2.5),
  turned into a :class:`~torch.nn.attention.flex_attention.BlockMask` once per forward. The compiled
  kernel skips the 128 x 128 tiles the mask rules out, keeps no mask or bias for the backward (only the
  output and a log-sum-exp per query and head), and reads k/v per kv head (``enable_gqa``: no copy).
  SpecForge builds DFlash's training mask the same way (sgl-project/SpecForge
  ``specforge/algorithms/common/dflash_family_model.py``, ``create_dflash_block_mask``, at commit
  a6b6b0230009d15ec2a97a57384e6f53f0f96946); the rule here is ours (context by position, padding by
  ``context_valid``), written again as a ``mask_mod`` and tested equal to the dense mask.

Which path (``[drafter] attention``): ``auto`` (the default) takes ``flex`` on a CUDA device when this
torch has it and ``dense`` elsewhere. Not flex on the CPU, because torch's flex_attention has no CPU
backward, and its uncompiled forward materialises every score anyway: no gain over SDPA there.
``dense`` and ``flex`` force a path. The two are equal in float32 on the CPU, outputs and gradients,
for Llama- and Qwen3-shaped drafters (tests/test_attention.py).

Never here: the q/k/v projections, RoPE or norms (``dflash.model.drafter``); this module only maps
``(q, k, v, mask)`` to the attention output.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

ATTENTION_BACKENDS = ("auto", "dense", "flex")
DENSE, FLEX = "dense", "flex"

_compiled: dict[tuple[str, str], Any] = {}  # (function, device type) -> its callable (compiled once on CUDA)


def flex_available() -> bool:
    """Whether this torch has ``flex_attention`` (2.5 and later)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(name: str, device: torch.device) -> str:
    """``auto`` -> ``flex`` on CUDA with a torch that has it, else ``dense``; ``dense``/``flex`` as named.

    ``flex`` named explicitly on a torch without it is an error: silently running another kernel would
    make a measured memory or speed figure mean something else.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    if name == FLEX and not flex_available():
        raise RuntimeError(f"drafter.attention = 'flex' needs torch >= 2.5 (flex_attention); this is "
                           f"torch {torch.__version__}; use 'auto' or 'dense'")
    if name == "auto":
        return FLEX if device.type == "cuda" and flex_available() else DENSE
    return name


# --------------------------------------------------------------------------- the rule, twice
def block_attention_mask(anchors: torch.Tensor, seq_len: int, block_size: int,
                         context_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean SDPA mask ``[b, 1, A*B, S + A*B]`` (True = may attend) for all blocks at once.

    Block ``j``'s slots see context position ``p`` iff ``p < anchors[j]`` (and ``context_valid[p]``
    when given), and the ``B`` slots of block ``j``; nothing else. Visibility of the context is
    decided by position, so overlapping anchors cannot leak. The reference: :func:`dflash_mask_mod`
    states the same rule per (query, key) pair and is tested equal to this.
    """
    b, a = anchors.shape
    dev = anchors.device
    pos = torch.arange(seq_len, device=dev)
    ctx = pos[None, None, :] < anchors[:, :, None]  # [b, A, S]
    if context_valid is not None:
        ctx = ctx & context_valid.bool()[:, None, :]
    ctx = ctx[:, :, None, :].expand(b, a, block_size, seq_len).reshape(b, a * block_size, seq_len)
    blk_id = torch.arange(a, device=dev).repeat_interleave(block_size)
    own = (blk_id[:, None] == blk_id[None, :])[None].expand(b, -1, -1)
    return torch.cat([ctx, own], dim=-1)[:, None]


def dflash_mask_mod(anchors: torch.Tensor, seq_len: int, block_size: int,
                    context_valid: torch.Tensor | None = None) -> Any:
    """The mask as flex_attention's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = may attend).

    Query ``q`` is slot ``q % B`` of block ``j = q // B``; key ``k < S`` is context position ``k``,
    key ``k >= S`` is slot ``(k - S) % B`` of block ``(k - S) // B``. Indices are clamped before they
    index ``anchors`` / ``context_valid``: the kernel evaluates the rule on the padding of its last
    tile too, and those results are discarded, but the reads must stay in bounds.

    What changes from item to item (``S``, the number of blocks) is captured as 0-d tensors, never as
    Python ints: compiled code guards on a captured int and would compile again for every new length
    (torch's recompile limit then falls back to the unfused kernel); a tensor's value is data.
    """
    dev = anchors.device
    seq = torch.tensor(seq_len, device=dev)
    last_block = torch.tensor(anchors.shape[1] - 1, device=dev)
    valid = context_valid.bool() if context_valid is not None else None

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        q_block = torch.minimum(q_idx // block_size, last_block)
        in_context = kv_idx < seq
        sees_context = in_context & (kv_idx < anchors[b, q_block])
        if valid is not None:
            sees_context = sees_context & valid[b, torch.minimum(kv_idx, seq - 1)]
        own_block = ~in_context & ((kv_idx - seq) // block_size == q_block)
        return sees_context | own_block

    return mask_mod


def flex_block_mask(anchors: torch.Tensor, seq_len: int, block_size: int,
                    context_valid: torch.Tensor | None = None) -> Any:
    """The mask as a flex ``BlockMask`` (batch ``b``, broadcast over heads), built on ``anchors``' device.

    On CUDA the builder is compiled (``torch.compile(create_block_mask)``, as SpecForge does), so it
    never holds the dense ``[A*B, S + A*B]`` mask; elsewhere it runs eagerly (it evaluates the rule on
    every pair once, as the dense mask would).
    """
    b, a = anchors.shape
    build = _compiled_fn("create_block_mask", anchors.device.type)
    return build(dflash_mask_mod(anchors, seq_len, block_size, context_valid), B=b, H=None, Q_LEN=a * block_size,
                 KV_LEN=seq_len + a * block_size, device=anchors.device)


def draft_mask(backend: str, anchors: torch.Tensor, seq_len: int, block_size: int,
               context_valid: torch.Tensor | None = None) -> Any:
    """The mask in the form ``backend`` (``dense`` or ``flex``, already resolved) applies."""
    if backend == FLEX:
        return flex_block_mask(anchors, seq_len, block_size, context_valid)
    return block_attention_mask(anchors, seq_len, block_size, context_valid)


# --------------------------------------------------------------------------- applying it
def _compiled_fn(name: str, device_type: str) -> Any:
    """``flex_attention`` or ``create_block_mask`` for ``device_type``: compiled once per process on CUDA
    (the fused kernel; shapes that change from item to item make torch compile once more, with dynamic
    sizes), eager elsewhere."""
    fn = _compiled.get((name, device_type))
    if fn is None:
        try:  # torch >= 2.5; resolve_backend picks flex only where flex_available(), so this is a guard
            from torch.nn.attention import flex_attention as fa
        except ImportError as e:
            raise RuntimeError(f"[drafter] attention = flex needs torch >= 2.5 (this is {torch.__version__})") from e
        fn = getattr(fa, name)
        if device_type == "cuda":
            fn = torch.compile(fn)
        _compiled[(name, device_type)] = fn
    return fn


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
    """Attention output ``[b, h, n_q, hd]`` of ``q`` ``[b, h, n_q, hd]`` over ``k``/``v`` ``[b, kv, n_k, hd]``.

    ``mask`` is what :func:`draft_mask` built: a boolean tensor (the dense path: k/v repeated to ``h``
    heads, then SDPA) or a BlockMask (flex, with native grouped-query attention). Both scale by
    ``1/sqrt(hd)``.
    """
    if isinstance(mask, torch.Tensor):
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return _compiled_fn("flex_attention", q.device.type)(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


__all__ = ["ATTENTION_BACKENDS", "DENSE", "FLEX", "attend", "block_attention_mask", "dflash_mask_mod",
           "draft_mask", "flex_available", "flex_block_mask", "resolve_backend"]
