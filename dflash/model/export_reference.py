"""The fixed input an export is checked on, and the manifest that carries its expected output.

An export must be checkable without the run and without the target (``dflash export --check DIR``
on a serving machine), yet a z-lab checkpoint holds no embedding and no LM head. So the reference
input is stored *after* the target's part of the computation: context states ``[1, C, K*d]``
(seeded noise), the block ``[anchor, MASK x (B-1)]`` already embedded with the target's table, and
``R`` rows of the target's LM head (each slot's argmax plus a seeded sample). The expected output
is the trained drafter's final hidden states and its logits on those rows. Everything the drafter
computes itself is then re-run from the export's own files, and compared.

The manifest (``dflash_export.json``) also names the source target, the capture layers in our
convention, the block size, the MASK token and the sha256 of every file, so a file changed after
export is caught even where the tensors still parse.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash.model.drafter import DFlashDrafter

MANIFEST = "dflash_export.json"
REFERENCE_FILE = "dflash_reference.safetensors"
MANIFEST_VERSION = 1
REFERENCE_SEED = 20260602
CONTEXT_LEN = 16  # context positions before the reference block's anchor
VOCAB_ROWS = 256  # LM-head rows the stored logits cover (all rows for a smaller vocabulary)
# Another reader of the same float32 weights (other attention kernel, other summation order) agrees
# to this; a wrong weight, norm or layer id moves logits by orders of magnitude more.
RTOL, ATOL = 1e-4, 1e-4


class ExportCheckError(Exception):
    """An export that fails a check; ``what`` names the key, tensor or file, ``detail`` says how.

    Defined here, beside the manifest and the reference every check reads, so that both checkers
    (:mod:`~dflash.model.export` and :mod:`~dflash.model.export_independent`) import it from below."""

    def __init__(self, what: str, detail: str) -> None:
        self.what = what
        self.detail = detail
        super().__init__(f"{what}: {detail}")


@dataclass(frozen=True)
class Reference:
    """The fixed input and the trained drafter's output on it (all float32 except the ids)."""

    context: torch.Tensor  # [1, C, K*d]
    block_ids: torch.Tensor  # [1, B] long: anchor token then MASK
    block_embeddings: torch.Tensor  # [1, B, d]: block_ids through the target's embedding
    anchors: torch.Tensor  # [1, 1] long: the block's anchor position (== C)
    vocab_rows: torch.Tensor  # [R] long
    head_rows: torch.Tensor  # [R, d]: those rows of the target's LM head
    hidden: torch.Tensor  # [1, B, d]: final-normed hidden states
    logits: torch.Tensor  # [1, B, R]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k).contiguous() for k in self.__dataclass_fields__}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> Reference:
        return cls(**{k: t[k] for k in cls.__dataclass_fields__})


def reference_input(drafter: DFlashDrafter, embed: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(context, block_ids, block_embeddings) for ``drafter``'s shape, from :data:`REFERENCE_SEED`."""
    spec = drafter.spec
    g = torch.Generator().manual_seed(REFERENCE_SEED)
    context = torch.randn(1, CONTEXT_LEN, spec.num_context_layers * spec.hidden_size, generator=g)
    anchor = int(torch.randint(spec.vocab_size, (1,), generator=g))
    block_ids = torch.full((1, spec.block_size), spec.mask_token_id, dtype=torch.long)
    block_ids[0, 0] = anchor
    with torch.no_grad():
        emb = embed(block_ids.to(embed.weight.device)).detach().to("cpu", torch.float32)
    return context, block_ids, emb


def run_drafter(drafter: DFlashDrafter, context: torch.Tensor, block_embeddings: torch.Tensor) -> torch.Tensor:
    """Final hidden states ``[1, B, d]`` of the one reference block, anchored right after the context."""
    dev = drafter.fc.weight.device
    anchors = torch.tensor([[context.shape[1]]], device=dev)
    with torch.no_grad():
        h = drafter.hidden_from_embeddings(context.to(dev, drafter.dtype), block_embeddings.to(dev), anchors)
    return h[:, 0].to("cpu", torch.float32)


def row_logits(hidden: torch.Tensor, head_rows: torch.Tensor) -> torch.Tensor:
    """Logits on the stored LM-head rows: one function for the export and every check."""
    return F.linear(hidden.to(torch.float32), head_rows.to(torch.float32))


def make_reference(drafter: DFlashDrafter) -> Reference:
    """The reference of a float32 ``drafter`` around its target's tables."""
    context, block_ids, emb = reference_input(drafter, drafter.embed_tokens)
    hidden = run_drafter(drafter, context, emb)
    head = drafter.lm_head
    if getattr(head, "bias", None) is not None:
        raise ValueError("the target's lm_head has a bias; DFlash exports assume a bias-free head")
    with torch.no_grad():
        full = drafter.logits(hidden.to(head.weight.device, drafter.dtype)).to("cpu", torch.float32)
    vocab = full.shape[-1]
    g = torch.Generator().manual_seed(REFERENCE_SEED + 1)
    wanted = set(full[0].argmax(-1).tolist())
    for i in torch.randperm(vocab, generator=g).tolist():
        if len(wanted) >= min(VOCAB_ROWS, vocab):
            break
        wanted.add(i)
    rows = torch.tensor(sorted(wanted), dtype=torch.long)
    head_rows = head.weight.detach()[rows.to(head.weight.device)].to("cpu", torch.float32)
    return Reference(context=context, block_ids=block_ids, block_embeddings=emb,
                     anchors=torch.tensor([[CONTEXT_LEN]]), vocab_rows=rows, head_rows=head_rows,
                     hidden=hidden, logits=row_logits(hidden, head_rows))


def compare(name: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when ``got`` matches ``want`` within float32 tolerance, else one line saying by how much."""
    if got.shape != want.shape:
        return f"{name}: shape {list(got.shape)}, expected {list(want.shape)}"
    if not torch.isfinite(got).all():
        return f"{name}: not finite"
    if torch.allclose(got, want, rtol=RTOL, atol=ATOL):
        return None
    return f"{name}: max |diff| {float((got - want).abs().max()):.3g} (tolerance {ATOL:g} + {RTOL:g}*|expected|)"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def write_manifest(out: Path, body: dict[str, Any], files: list[str]) -> Path:
    """``dflash_export.json``: ``body`` plus the sha256 of each of ``files`` (already written)."""
    manifest = {"manifest_version": MANIFEST_VERSION, **body,
                "files": {name: sha256_of(out / name) for name in files}}
    path = out / MANIFEST
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True), encoding="utf-8")
    return path


__all__ = ["ATOL", "CONTEXT_LEN", "MANIFEST", "MANIFEST_VERSION", "REFERENCE_FILE", "RTOL", "Reference", "compare",
           "make_reference", "read_json", "reference_input", "row_logits", "run_drafter", "sha256_of", "write_manifest"]
