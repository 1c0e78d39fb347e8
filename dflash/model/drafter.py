"""The DFlash block-diffusion drafter and its training loss (docs/REFERENCE.md, "The DFlash drafter").

Shape of the model:

* **Context.** The target's K captured states per position (``[b, S, K*d]``, from
  :class:`dflash.model.target.HiddenStateCapture`) are fused: ``Linear(K*d -> d, no bias)`` then RMSNorm.
  Every draft layer reads the same fused context.
* **Block.** A block anchored at position ``a`` is ``[token[a], MASK x (B-1)]``, embedded with the
  target's own embedding table; slot ``k`` sits at RoPE position ``a + k`` and predicts
  ``token[a + k]`` (slot 0 has no loss).
* **Layers.** ``N`` Qwen3-style decoder layers at the target's hidden size, whatever the target's
  family, exactly as upstream's ``DFlashDraftModel`` (z-lab ``dflash/model.py``) builds them:
  RMSNorm, attention with its own q/k/v/o projections (no bias), RMSNorm on q and k per head, RoPE,
  gated SiLU MLP. Queries come only from block tokens; keys/values are
  ``[k/v_proj(context) ; k/v_proj(block)]``, non-causal inside the block. Parameter names are
  upstream's, so the state dict *is* the z-lab checkpoint's (:mod:`dflash.model.export`).
* **Head.** Final RMSNorm, then the target's ``lm_head``.

The target's ``embed_tokens`` and ``lm_head`` are *shared references*, frozen, and deliberately not
registered as submodules: ``parameters()``, ``state_dict()``, ``.to()`` and the optimizer see only
the drafter's own weights, and a checkpoint holds only those (a few MB instead of the vocabulary
tables). When the drafter lives on another device than the target, :meth:`DFlashDrafter.from_target`
copies the two frozen tables to that device once.

**Training, all blocks in one forward.** For a sequence with anchors ``a_0..a_{A-1}`` the keys are
``[context (S) | block_0 | ... | block_{A-1}]`` and the queries are the ``A*B`` block slots. Query
slots of block ``j`` may see context position ``p`` iff ``p < a_j`` (strictly before its own anchor,
decided by *position*, never by block index: anchors may be closer than ``B`` apart, and a
block-index rule would then leak the tokens the block must predict) and the slots of block ``j``
itself, in both directions; nothing of any other block. :mod:`dflash.model.attention` applies that
rule either as one boolean mask for ``torch.nn.functional.scaled_dot_product_attention`` (the dense
reference; CPU training) or as a flex_attention block mask (CUDA: tiles the mask rules out are
skipped, no bias is kept, k/v are not copied per head); ``spec.attention`` chooses.

**Loss.** Cross-entropy at slots ``k = 1..B-1`` weighted by ``w_k = exp(-(k-1)/gamma)``, counted
only where ``a + k`` is inside the sequence and ``loss_mask[a + k]`` is 1 (upstream's convention: the
drafter learns the response only, never the user's text, which the target does not generate).
:meth:`DFlashDrafter.loss` returns the weighted *sum* and the counts, so that data-parallel workers
and gradient accumulation can divide by the global sum of the weights of the counted positions, as
upstream (SpecForge) normalises (:func:`normalised_loss`): the weighted mean of the cross-entropy.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from dflash.core.config import DrafterConfig, default_gamma
from dflash.core.errors import ConfigError
from dflash.model.attention import ATTENTION_BACKENDS, attend, block_attention_mask, draft_mask, resolve_backend
from dflash.model.chunked_ce import DEFAULT_CHUNK_ROWS, chunked_linear_cross_entropy

WEIGHTS_FILE = "drafter.safetensors"
CONFIG_FILE = "drafter_config.json"
SPEC_FORMAT = 2  # 2: Qwen3-style draft layers for every target (1: layers of the target's family)

# Candidate MASK tokens, in order of preference, for tokenizers without a ``mask_token``. A mask must
# be an existing embedding row the chat data never uses. SmolLM2 has no spare rows (vocab 49,152 ==
# embedding rows) and no mask token; ``<empty_output>`` (id 16) is a leftover StarCoder special
# token that chat text never contains.
MASK_TOKEN_CANDIDATES = ("<|MASK|>", "<|mask|>", "<mask>", "<empty_output>", "<|fim_pad|>",
                         "<|reserved_special_token_0|>")


def default_mask_token_id(tokenizer: Any) -> int:
    """The MASK token id for ``tokenizer``: its ``mask_token_id`` if it has one, else the first of
    :data:`MASK_TOKEN_CANDIDATES` present in its vocabulary (SmolLM2 -> 16, ``<empty_output>``)."""
    mid = getattr(tokenizer, "mask_token_id", None)
    if isinstance(mid, int) and mid >= 0:
        return mid
    vocab = tokenizer.get_vocab()
    for tok in MASK_TOKEN_CANDIDATES:
        if tok in vocab:
            return int(vocab[tok])
    raise ValueError("the tokenizer has no mask token and none of "
                     f"{', '.join(MASK_TOKEN_CANDIDATES)}; pass mask_token_id explicitly")


# --------------------------------------------------------------------------- spec
@dataclass(frozen=True)
class DrafterSpec:
    """Everything that fixes the drafter's shape and training rule; saved with its weights.

    Target-side fields copy the target's config (the draft layers run at its size and RoPE base);
    drafter-side fields are ``[drafter]`` of the run config plus the capture layers and MASK id.
    The layers are always Qwen3-style (q/k norms, no attention bias), as upstream's.
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    layers: int = 5
    block_size: int = 16
    anchors: int = 512
    gamma: float = 7.0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    loss_chunk_rows: int = DEFAULT_CHUNK_ROWS  # LM-head rows per chunk of the loss (memory, not the result)
    checkpoint_layers: bool = False  # recompute each draft layer in the backward (memory, not the result)
    attention: str = "auto"  # dense mask or flex block mask (dflash.model.attention; speed and memory, not the result)

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                     "vocab_size", "layers", "anchors", "loss_chunk_rows"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"DrafterSpec.{name} must be an integer >= 1, got {v!r}")
        if self.block_size < 2:
            raise ValueError(f"DrafterSpec.block_size must be >= 2, got {self.block_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (RoPE)")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must not be empty")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is not a row of a {self.vocab_size}-row table")
        if not self.gamma > 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}")
        if not isinstance(self.checkpoint_layers, bool):
            raise ValueError(f"checkpoint_layers must be true or false, got {self.checkpoint_layers!r}")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention!r}")

    @property
    def num_context_layers(self) -> int:
        return len(self.target_layer_ids)

    def slot_weights(self, device: torch.device | str | None = None,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[B]`` loss weights per slot: 0 for slot 0, ``exp(-(k-1)/gamma)`` for k >= 1 (computed in
        Python doubles, so a float64 loss is exact and no device needs float64 support)."""
        w = [0.0] + [math.exp(-(k - 1) / self.gamma) for k in range(1, self.block_size)]
        return torch.tensor(w, dtype=dtype, device=device)

    @classmethod
    def from_target_config(cls, config: Any, *, target_layer_ids: Sequence[int], mask_token_id: int,
                           drafter: DrafterConfig | None = None, **overrides: Any) -> DrafterSpec:
        """Spec from a transformers config of the target plus ``[drafter]`` settings.

        ``gamma`` defaults to :func:`dflash.core.config.default_gamma` of the block size. Only default
        RoPE is modelled (``rope_theta``); scaled RoPE variants (e.g. Llama 3.1's) are not.
        """
        d = drafter or DrafterConfig()
        heads = int(config.num_attention_heads)
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
        kw: dict[str, Any] = dict(
            hidden_size=int(config.hidden_size), num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim), intermediate_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size), target_layer_ids=tuple(target_layer_ids),
            mask_token_id=int(mask_token_id), layers=d.layers, block_size=d.block_size, anchors=d.anchors,
            gamma=float(d.gamma if d.gamma is not None else default_gamma(d.block_size)),
            loss_chunk_rows=d.loss_chunk_rows, checkpoint_layers=d.checkpoint_layers, attention=d.attention,
            rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)), rope_theta=float(theta))
        kw.update(overrides)
        return cls(**kw)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["target_layer_ids"] = list(self.target_layer_ids)
        out["format"] = SPEC_FORMAT
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DrafterSpec:
        """The spec saved by :meth:`to_json`; a format-1 spec only if its layers were already
        Qwen3-style (then the weights are the same tensors and the same math: an exact conversion),
        else :class:`DrafterFormatError`."""
        fmt = data.get("format", 1)
        if fmt == 1 and not (data.get("qk_norm") and not data.get("attention_bias")):
            raise DrafterFormatError(
                "this drafter was saved with draft layers of its target's family (no q_norm/k_norm"
                f"{', attention bias' if data.get('attention_bias') else ''}; drafter format 1); draft layers are"
                " now Qwen3-style as upstream DFlash's and cannot be converted exactly: retrain it with dflash train")
        if fmt not in (1, SPEC_FORMAT):
            raise DrafterFormatError(f"drafter format {fmt!r} is not one this dflash reads (1 or {SPEC_FORMAT})")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class DrafterFormatError(ConfigError):
    """A saved drafter this version cannot load as it is; the message says what to do. A
    :class:`~dflash.core.errors.ConfigError`, so every verb reports it as one line, exit status 2."""

    def __init__(self, what: str) -> None:
        super().__init__("drafter", what, show_got=False)


# --------------------------------------------------------------------------- building blocks
class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalise in (at least) float32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        x32 = x.to(torch.promote_types(dt, torch.float32))
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dt)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, h, n, hd]; cos/sin: [b, n, hd] (the Llama/Qwen half-rotation convention)."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class DraftAttention(nn.Module):
    """Queries from the block; keys/values from ``[context ; block]`` with this layer's projections."""

    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        d, h, kv, hd = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.h, self.kv, self.hd = h, kv, hd
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, kv * hd, bias=False)
        self.v_proj = nn.Linear(d, kv * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, spec.rms_norm_eps)  # per head, before RoPE (Qwen3)
        self.k_norm = RMSNorm(hd, spec.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope_q: tuple[torch.Tensor, torch.Tensor],
                rope_k: tuple[torch.Tensor, torch.Tensor], mask: Any) -> torch.Tensor:
        b, nq, _ = x.shape
        kv_in = torch.cat([ctx, x], dim=1)
        nk = kv_in.shape[1]
        q = self.q_proj(x).view(b, nq, self.h, self.hd)
        k = self.k_proj(kv_in).view(b, nk, self.kv, self.hd)
        v = self.v_proj(kv_in).view(b, nk, self.kv, self.hd)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = _rope(q, *rope_q)
        k = _rope(k, *rope_k)
        out = attend(q, k, v, mask)  # dense boolean mask or flex block mask (dflash.model.attention)
        return self.o_proj(out.transpose(1, 2).reshape(b, nq, self.h * self.hd))


class DraftMLP(nn.Module):
    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """Pre-norm decoder layer. The fused context is already normalised once (the fusion RMSNorm), as
    upstream does, so only the block stream goes through ``input_layernorm``."""

    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = DraftAttention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = DraftMLP(spec)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope_q: Any, rope_k: Any, mask: Any) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_k, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


# --------------------------------------------------------------------------- anchors
# The training reference's rule: SpecForge's DFlash trainer (sgl-project/SpecForge,
# specforge/algorithms/common/dflash_family_model.py, OnlineDFlashModel._sample_anchor_positions, commit
# a6b6b0230009d15ec2a97a57384e6f53f0f96946; the rule since 7757409f, 2026-07-30, which replaced the
# full-block rule ``loss_mask[p] and p <= S - B`` that this module had copied from its earlier version).
def anchor_eligible(loss_mask: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """``[b, S]`` bool: where a block may be anchored. ``p`` is eligible iff ``loss_mask[p]`` and
    ``loss_mask[p + 1]`` (the anchor's clean token and the block's first target are both response
    tokens) and ``p + 1 < length`` (``lengths`` defaults to the padded width ``S``).

    Why this and not "the whole block fits": it is the training reference's rule. A block that runs
    past the sequence's (or the response's) end is trained on the slots that are still response
    tokens, under their usual weights ``w_k`` (:meth:`DFlashDrafter.loss` counts slot ``k`` iff
    ``a + k < S`` and ``loss_mask[a + k]``), so a response shorter than the block still teaches its
    first tokens, and the last ``B - 2`` positions of every response are anchors too. The comparison of
    the two rules at equal target tokens is in benchmarks/RESULTS.md ("Anchor rule").
    """
    if loss_mask.dim() != 2:
        raise ValueError("loss_mask must be [batch, seq]")
    lm = loss_mask.bool()
    s = lm.shape[1]
    ok = torch.zeros_like(lm)
    ok[:, : s - 1] = lm[:, : s - 1] & lm[:, 1:]
    if lengths is not None:
        ok &= torch.arange(s, device=lm.device)[None, :] + 1 < lengths.to(lm.device).long()[:, None]
    return ok


def sample_anchors(loss_mask: torch.Tensor, block_size: int, max_anchors: int,
                   generator: torch.Generator | None = None,
                   lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchor positions per sequence: ``(anchors [b, A] long, valid [b, A] bool)``, sorted per row.

    Eligible: :func:`anchor_eligible` (the training reference's rule: ``loss_mask[p]`` and
    ``loss_mask[p + 1]``, inside the real sequence; a block may run past the end, its partial slots
    count under their weights). ``block_size`` does not restrict eligibility; it is kept for callers.
    Up to ``max_anchors`` per row, drawn uniformly without replacement with ``generator``
    (deterministic for a seeded generator, drawn on the CPU whatever the mask's device), as upstream
    draws them. ``A`` is the largest count over the rows; shorter rows are padded with position 0 and
    ``valid`` False. Rows with no eligible position (no two consecutive response tokens) get none.
    """
    if loss_mask.dim() != 2:
        raise ValueError("loss_mask must be [batch, seq]")
    b, s = loss_mask.shape
    lm = loss_mask.detach().to("cpu").bool()
    lens = (torch.full((b,), s, dtype=torch.long) if lengths is None
            else lengths.detach().to("cpu").long())
    ok = anchor_eligible(lm, lens)
    rows: list[torch.Tensor] = []
    for r in range(b):
        elig = torch.nonzero(ok[r], as_tuple=False).flatten()
        if elig.numel() > max_anchors:
            pick = torch.randperm(elig.numel(), generator=generator)[:max_anchors]
            elig = elig[pick].sort().values
        rows.append(elig)
    a = max((int(x.numel()) for x in rows), default=0)
    anchors = torch.zeros((b, a), dtype=torch.long)
    valid = torch.zeros((b, a), dtype=torch.bool)
    for r, x in enumerate(rows):
        anchors[r, : x.numel()] = x
        valid[r, : x.numel()] = True
    return anchors.to(loss_mask.device), valid.to(loss_mask.device)


# --------------------------------------------------------------------------- losses
@dataclass(frozen=True)
class DraftLoss:
    """One forward's loss, unnormalised: ``loss_sum`` = sum over counted slots of ``w_k * CE``.

    ``tokens``: counted (slot, anchor) predictions; ``weight_sum``: sum of their ``w_k``;
    ``anchors``: valid anchors; ``correct``: counted predictions whose argmax is the target (a cheap
    training accuracy); ``context_seen``: context positions the valid blocks attend to, summed over
    blocks (the attention's size, for the model FLOPs: :mod:`dflash.model.flops`). Counts are Python
    numbers already reduced on this worker; sum them across workers and accumulation steps before
    normalising.
    """

    loss_sum: torch.Tensor
    tokens: int
    weight_sum: float
    anchors: int
    correct: int
    context_seen: int = 0

    def mean(self, by: str = "weights") -> torch.Tensor:
        """This forward's own mean (for logging, or when it is the whole global batch); ``by`` is
        ``"weights"`` (upstream's: the sum of the weights of the valid positions) or ``"tokens"``."""
        if by not in ("tokens", "weights"):
            raise ValueError(f"by must be 'tokens' or 'weights', got {by!r}")
        return normalised_loss(self.loss_sum, self.tokens if by == "tokens" else self.weight_sum)


def _context_seen(anchors: torch.Tensor, valid: torch.Tensor, context_valid: torch.Tensor | None) -> torch.Tensor:
    """Context positions the valid blocks see, summed (a 0-d tensor): the real positions before each anchor."""
    if context_valid is None:
        return (anchors * valid).sum()
    real_before = context_valid.long().cumsum(1).gather(1, (anchors - 1).clamp(min=0))  # real positions <= a - 1
    return (real_before * (valid & (anchors > 0))).sum()


def normalised_loss(loss_sum: torch.Tensor, denominator: float) -> torch.Tensor:
    """``loss_sum / denominator``, where the denominator is the GLOBAL count over every worker and
    accumulation micro-step of the optimizer step (the weight sum, as upstream normalises; the token
    count is the alternative). A zero denominator gives a zero loss that still
    backpropagates (zeros), so a worker with no anchors takes part in a synchronised step."""
    return loss_sum / denominator if denominator > 0 else loss_sum * 0.0


# --------------------------------------------------------------------------- the drafter
class DFlashDrafter(nn.Module):
    """The DFlash drafter (module docstring). Build with :meth:`from_target` or :meth:`load`."""

    def __init__(self, spec: DrafterSpec, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.spec = spec
        d = spec.hidden_size
        self.fc = nn.Linear(spec.num_context_layers * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, spec.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(spec) for _ in range(spec.layers))
        self.norm = RMSNorm(d, spec.rms_norm_eps)
        # RoPE frequencies stay float32 whatever the drafter's dtype (a buffer would be cast by .to()).
        self._inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, spec.head_dim, 2, dtype=torch.float32)
                                                     / spec.head_dim))
        self._init_weights()
        # Shared frozen tables, deliberately NOT registered (see the module docstring).
        for name, mod in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
            for p in mod.parameters():
                p.requires_grad_(False)
            self.__dict__[name] = mod
        rows = embed_tokens.weight.shape[0]
        if spec.mask_token_id >= rows:
            raise ValueError(f"mask_token_id {spec.mask_token_id} is not a row of the {rows}-row embedding")

    def _init_weights(self) -> None:
        """Upstream's initialisation (HF ``post_init``: Linear ``N(0, 0.02)``, norms 1), except the final
        norm, which starts at ``1/sqrt(d)`` so the drafter's first output is a unit vector and no logit
        exceeds its LM-head row's norm.

        Why: the block stream carries the MASK token's embedding through the residual, and with a tied
        LM head (SmolLM2, small Qwen3s) ``lm_head(norm(e_mask))`` puts a logit of ``|e_mask| sqrt(d)``
        (79 for SmolLM2) on the MASK token: the first loss was 77 (weighted mean; 41 per token) against
        ln V = 10.8. Measured on SmolLM2 (/work/notes/h9/measure.py, 240 steps): final norm 1 -> first
        loss 77.5, held-out loss 7.51 and slot accuracy 0.053; 0.1 -> 14.0, 7.33, 0.043; 1/sqrt(d) ->
        12.0, 7.36, 0.047 (accuracy within noise; acceptance is argmax, which the scale does not change).
        """
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        with torch.no_grad():
            self.norm.weight.fill_(self.spec.hidden_size ** -0.5)

    # ---- construction ---------------------------------------------------------------
    @classmethod
    def from_target(cls, target: nn.Module, spec: DrafterSpec, *, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> DFlashDrafter:
        """A fresh drafter around ``target``'s frozen embedding and LM head.

        On the target's device the two tables are shared; on another ``device`` they are copied
        there once (a drafter GPU cannot read a table on a target GPU), still frozen.
        """
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        if head is None:
            raise ValueError("the target has no output embeddings (lm_head)")
        dev = torch.device(device) if device is not None else embed.weight.device
        if embed.weight.device != dev:
            tied = head.weight is embed.weight
            embed = _frozen_copy(embed, dev)
            head = _frozen_copy(head, dev)
            if tied:
                head.weight = embed.weight
        drafter = cls(spec, embed, head)
        return drafter.to(device=dev, dtype=dtype or embed.weight.dtype)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Draft layers, fusion projection and norms (every registered parameter)."""
        return [p for p in self.parameters() if p.requires_grad]

    # ---- pieces -----------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def fuse(self, context_states: torch.Tensor) -> torch.Tensor:
        """``[b, S, K*d]`` captured states -> ``[b, S, d]`` context.

        Under autocast the received (bf16) states go to ``fc`` as they are: autocast computes the
        projection in bf16 anyway, so a float32 copy of the whole item (and autocast's bf16 cast of
        that copy, kept for the backward) would be two more item-sized buffers for the same result.
        Without autocast (the CPU's float32 run) the states are cast to the weights' dtype.
        """
        x = context_states
        if x.dtype != self.dtype and not torch.is_autocast_enabled(x.device.type):
            x = x.to(self.dtype)
        return self.hidden_norm(self.fc(x))

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions.to(torch.float32)[..., None] * self._inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids).to(self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states -> vocabulary logits through the target's frozen head."""
        return self.lm_head(hidden.to(self.lm_head.weight.dtype))

    def block_hidden(self, context_states: torch.Tensor, anchor_tokens: torch.Tensor,
                     anchors: torch.Tensor, context_valid: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states ``[b, A, B, d]`` of the blocks anchored at ``anchors`` ``[b, A]``
        whose slot 0 holds ``anchor_tokens`` ``[b, A]``; all blocks in one forward."""
        b, a = anchors.shape
        bs = self.spec.block_size
        block_ids = torch.full((b, a, bs), self.spec.mask_token_id, dtype=torch.long, device=context_states.device)
        block_ids[:, :, 0] = anchor_tokens
        return self.hidden_from_embeddings(context_states, self._embed(block_ids.view(b, a * bs)), anchors,
                                           context_valid)

    def hidden_from_embeddings(self, context_states: torch.Tensor, x: torch.Tensor, anchors: torch.Tensor,
                               context_valid: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`block_hidden` from already embedded blocks ``x`` ``[b, A*B, d]``: everything the
        drafter computes itself, without the target's tables (an export's check runs this)."""
        b, a = anchors.shape
        bs = self.spec.block_size
        s = context_states.shape[1]
        dev = context_states.device
        x = x.to(self.dtype)
        q_pos = (anchors[:, :, None] + torch.arange(bs, device=dev)).view(b, a * bs)
        k_pos = torch.cat([torch.arange(s, device=dev).expand(b, s), q_pos], dim=1)
        rope_q, rope_k = self._cos_sin(q_pos), self._cos_sin(k_pos)
        mask = draft_mask(resolve_backend(self.spec.attention, dev), anchors, s, bs, context_valid)
        ctx = self.fuse(context_states)
        recompute = self.spec.checkpoint_layers and torch.is_grad_enabled()
        for layer in self.layers:
            if recompute:  # keep only the layer's input; its activations are rebuilt in the backward
                x = torch.utils.checkpoint.checkpoint(layer, x, ctx, rope_q, rope_k, mask, use_reentrant=False)
            else:
                x = layer(x, ctx, rope_q, rope_k, mask)
        return self.norm(x).view(b, a, bs, -1)

    def block_logits(self, context_states: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                     context_valid: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[b, A, B, V]`` of every slot of the blocks at ``anchors`` (slot 0 included)."""
        tok = input_ids.gather(1, anchors)
        return self.logits(self.block_hidden(context_states, tok, anchors, context_valid))

    # ---- training ---------------------------------------------------------------------
    def loss(self, context_states: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
             attention_mask: torch.Tensor | None = None, *, anchors: torch.Tensor | None = None,
             anchor_valid: torch.Tensor | None = None,
             generator: torch.Generator | None = None) -> DraftLoss:
        """Weighted block cross-entropy of a right-padded batch, summed (not averaged).

        ``context_states`` ``[b, S, K*d]``, ``input_ids`` ``[b, S]``, ``loss_mask`` ``[b, S]`` (1 on
        response tokens), ``attention_mask`` ``[b, S]`` (1 on real tokens; None = all real).
        ``anchors``/``anchor_valid`` ``[b, A]`` fix the blocks (tests, replay); otherwise up to
        ``spec.anchors`` per sequence are sampled with ``generator`` (:func:`sample_anchors`).

        A slot ``k`` of a block at ``a`` counts iff its anchor is valid, ``a + k < S`` and
        ``loss_mask[a + k]``; its weight is ``w_k``. Only counted rows go through the LM head (the
        dominant cost: ``rows x vocab x d``), ``spec.loss_chunk_rows`` at a time with the gradient
        formed in the same pass (:mod:`dflash.model.chunked_ce`): the ``[rows, vocab]`` logits are
        never held at once, so the loss's memory is one chunk's, not the item's.
        """
        spec = self.spec
        bs = spec.block_size
        b, s = input_ids.shape
        dev = input_ids.device
        lm = loss_mask.to(dev).bool()
        valid_ctx = attention_mask.to(dev).bool() if attention_mask is not None else None
        if anchors is None:
            lengths = valid_ctx.sum(1) if valid_ctx is not None else None
            anchors, anchor_valid = sample_anchors(lm, bs, spec.anchors, generator, lengths)
        elif anchor_valid is None:
            anchor_valid = torch.ones_like(anchors, dtype=torch.bool)
        anchors, anchor_valid = anchors.to(dev), anchor_valid.to(dev).bool()
        counts = torch.stack([anchor_valid.sum(), _context_seen(anchors, anchor_valid, valid_ctx)])
        n_anchor, seen = (int(x) for x in counts.tolist())  # one host sync for both
        if anchors.shape[1] == 0 or n_anchor == 0:
            zero = sum(p.sum() for p in self.trainable_parameters()) * 0.0
            return DraftLoss(zero.float(), 0, 0.0, 0, 0)

        hidden = self.block_hidden(context_states, input_ids.gather(1, anchors), anchors, valid_ctx)
        tpos = anchors[:, :, None] + torch.arange(bs, device=dev)  # [b, A, B]
        inside = tpos < s
        tpos_c = tpos.clamp(max=s - 1)
        tgt = input_ids.gather(1, tpos_c.view(b, -1)).view(b, -1, bs)
        counted = inside & lm.gather(1, tpos_c.view(b, -1)).view(b, -1, bs) & anchor_valid[:, :, None]
        counted[:, :, 0] = False
        rows = hidden[counted]
        if rows.shape[0] == 0:
            zero = hidden.sum() * 0.0
            return DraftLoss(zero.float(), 0, 0.0, n_anchor, 0, seen)
        head_dtype = torch.promote_types(self.lm_head.weight.dtype, torch.float32)
        w = spec.slot_weights(dev, head_dtype).expand_as(counted)[counted]
        loss_sum, correct = chunked_linear_cross_entropy(rows, self.lm_head, tgt[counted], w, spec.loss_chunk_rows)
        return DraftLoss(loss_sum=loss_sum, tokens=int(rows.shape[0]), weight_sum=float(w.sum()),
                         anchors=n_anchor, correct=correct, context_seen=seen)

    # ---- inference ----------------------------------------------------------------------
    @torch.no_grad()
    def draft_block(self, context_states: torch.Tensor, anchor_token: torch.Tensor | int,
                    position: torch.Tensor | int | None = None) -> torch.Tensor:
        """Logits ``[b, B-1, V]`` for slots 1..B-1 of one block per sequence (speculative decoding).

        ``context_states`` ``[b, C, K*d]``: the target's captured states of positions ``0..C-1``;
        ``anchor_token`` ``[b]`` (or an int): the last accepted token, at ``position`` (default
        ``C``: right after the context). Only context positions ``< position`` are seen, exactly as
        in training. Greedy drafts are ``draft_block(...).argmax(-1)``.
        """
        if context_states.dim() == 2:
            context_states = context_states[None]
        b, c = context_states.shape[:2]
        dev = context_states.device
        tok = torch.as_tensor(anchor_token, device=dev, dtype=torch.long).reshape(-1).expand(b)
        pos = torch.as_tensor(c if position is None else position, device=dev, dtype=torch.long)
        pos = pos.reshape(-1).expand(b)
        hidden = self.block_hidden(context_states, tok[:, None], pos[:, None])
        return self.logits(hidden[:, 0, 1:])

    # ---- persistence --------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        """Write the trainable weights (safetensors) and the spec (JSON) into ``directory``.

        Only the drafter's own weights: the target's tables are not saved (load with the same
        target). Each file is written to a temporary name and renamed, so a crash never leaves a
        half-written file under the final name.
        """
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        fd, tmp = tempfile.mkstemp(prefix=f".{WEIGHTS_FILE}.", dir=out)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata={"format": "dflash-drafter", "dtype": str(self.dtype)})
            os.replace(tmp, out / WEIGHTS_FILE)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        cfg = json.dumps({"spec": self.spec.to_json(), "dtype": str(self.dtype).removeprefix("torch.")},
                         indent=2, sort_keys=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{CONFIG_FILE}.", dir=out)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(cfg)
        os.replace(tmp, out / CONFIG_FILE)
        return out

    @classmethod
    def load(cls, directory: str | Path, target: nn.Module, *, device: torch.device | str | None = None,
             dtype: torch.dtype | None = None) -> DFlashDrafter:
        """A saved drafter around ``target``'s frozen tables (the dtype it was saved in unless given)."""
        from safetensors.torch import load_file

        src = Path(directory)
        meta = json.loads((src / CONFIG_FILE).read_text(encoding="utf-8"))
        try:
            spec = DrafterSpec.from_json(meta["spec"])
        except DrafterFormatError as exc:
            raise DrafterFormatError(f"{src}: {exc.allowed}") from None
        saved_dtype = getattr(torch, meta.get("dtype", "float32"))
        drafter = cls.from_target(target, spec, device=device, dtype=dtype or saved_dtype)
        state = load_file(str(src / WEIGHTS_FILE), device=str(drafter.fc.weight.device))
        drafter.load_state_dict(state, strict=True)
        return drafter


def _frozen_copy(mod: nn.Module, device: torch.device) -> nn.Module:
    import copy

    new = copy.deepcopy(mod).to(device)
    for p in new.parameters():
        p.requires_grad_(False)
    return new


def lm_head_flops(anchors: int, block_size: int, vocab: int, hidden: int) -> float:
    """Forward FLOPs of the LM head over all slots (docs/REFERENCE.md's dominant-cost estimate)."""
    return 2.0 * anchors * block_size * vocab * hidden


__all__ = [
    "CONFIG_FILE", "MASK_TOKEN_CANDIDATES", "WEIGHTS_FILE", "DFlashDrafter", "DraftLoss", "DrafterFormatError",
    "DrafterSpec", "anchor_eligible", "block_attention_mask", "default_mask_token_id", "lm_head_flops",
    "normalised_loss", "sample_anchors",
]
