"""The drafter's model FLOPs per training step, the device's peak, and MFU = achieved / peak.

Why: a step's wall time says how fast the drafter trains, not how much of the GPU it uses. Model FLOPs
utilisation (MFU, PaLM's definition: the FLOPs the *model* needs per step over the time the step took,
divided by the device's peak) says that, and is comparable across shapes, devices and runs.

**Model FLOPs** count what the drafter's math needs, from its shapes, never what a kernel happens to do:
padding (pad tokens, padding anchors), attention to pairs the mask rules out, and recomputation
(``checkpoint_layers``, a flash kernel's backward) are not counted. One multiply-add is 2 FLOPs. For one
item, with hidden ``d``, attention width ``H = heads x head_dim``, key/value width ``KV = kv_heads x
head_dim``, MLP width ``I``, ``L`` draft layers, ``K`` captured target layers, vocabulary ``V`` and
block size ``B``, and the item's counts

* ``T``: real context tokens (the attention mask's sum),
* ``n``: valid blocks (anchors), so ``Q = n x B`` query positions,
* ``P``: context positions the blocks see, summed over blocks (block ``j`` sees the real positions before
  its anchor ``a_j``: ``a_j`` of them in a right-padded row),
* ``R``: LM-head rows (counted predictions: valid slot 1..B-1 inside the sequence on response tokens),

the forward is

* fusion ``fc``: ``2 T (K d) d``;
* per layer: q and o projections ``2 x 2 Q d H``; k and v over ``[context ; blocks]``
  ``2 x 2 (T + Q) d KV``; MLP ``3 x 2 Q d I``; attention ``QK^T`` and ``PV`` over the attended pairs only,
  ``2 x 2 x heads x head_dim x B (P + Q)`` (each of a block's ``B`` queries sees ``P_j`` context keys
  and the block's ``B`` slots);
* LM head ``2 R d V``;

and a training step counts each part's backward by what it needs: the draft layers' matmuls and the
attention 2 x forward (gradient of the input and of the weight, or of q, k and v), so 3 x in all; ``fc``
1 x more (its input, the target's states, needs no gradient); the frozen LM head 1 x more (the gradient
of its input only). Elementwise work (norms, RoPE, SiLU, softmax) is not counted, as is usual.

The check: ``torch.utils.flop_counter.FlopCounterMode`` over a real forward and backward on a shape
without padding equals this count exactly outside the attention, and the attention it counts (dense,
every pair) is this count's attention times all pairs / attended pairs (tests/test_flops.py).

**Peak**: dense bf16 tensor-core FLOP/s (no 2:4 sparsity), matched by the device name NVML (and CUDA)
reports; an unknown device, and the CPU, has none, and its MFU is ``None`` (reported as n/a).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepCounts:
    """One item's counts the FLOPs depend on (module docstring: ``T``, ``n``, ``P``, ``R``)."""

    context_tokens: int
    blocks: int
    context_seen: int
    rows: int


@dataclass(frozen=True)
class DrafterFlops:
    """Forward FLOPs of one item by part, and the training step's (forward + backward) total."""

    fuse: float
    layers: float  # the draft layers' projections and MLPs, all layers
    attention: float  # QK^T and PV over the attended pairs, all layers
    lm_head: float

    @property
    def forward(self) -> float:
        return self.fuse + self.layers + self.attention + self.lm_head

    @property
    def train(self) -> float:
        """Forward + backward: 3 x the draft layers and the attention, 2 x ``fc`` and the frozen LM head."""
        return 3.0 * (self.layers + self.attention) + 2.0 * (self.fuse + self.lm_head)


def drafter_flops(spec: Any, counts: StepCounts) -> DrafterFlops:
    """The model FLOPs of one item through a drafter of ``spec`` (a :class:`~dflash.model.drafter.DrafterSpec`)."""
    d, i, v, b = spec.hidden_size, spec.intermediate_size, spec.vocab_size, spec.block_size
    h = spec.num_heads * spec.head_dim
    kv = spec.num_kv_heads * spec.head_dim
    t, q = counts.context_tokens, counts.blocks * b
    per_layer = 2.0 * 2 * q * d * h + 2.0 * 2 * (t + q) * d * kv + 2.0 * 3 * q * d * i
    pairs = b * (counts.context_seen + q)  # per head: each block's B queries x (its context + its B slots)
    return DrafterFlops(fuse=2.0 * t * spec.num_context_layers * d * d, layers=spec.layers * per_layer,
                        attention=spec.layers * 2.0 * 2 * pairs * h, lm_head=2.0 * counts.rows * d * v)


def train_flops(spec: Any, counts: StepCounts) -> float:
    """Model FLOPs of one item's forward and backward (:attr:`DrafterFlops.train`)."""
    return drafter_flops(spec, counts).train


# --------------------------------------------------------------------------- peaks
@dataclass(frozen=True)
class DevicePeak:
    """A device's dense bf16 tensor-core peak and where the figure comes from."""

    name: str
    flops: float  # FLOP/s, dense (no structured sparsity)
    source: str


_H100 = "https://www.nvidia.com/en-us/data-center/h100/"
_H200 = "https://www.nvidia.com/en-us/data-center/h200/"
# Ordered: a more specific pattern before the one it contains. Vendor datasheets give bf16 "with sparsity";
# the dense peak is half ("specifications one-half lower without sparsity", the H100 page's footnote).
PEAKS: tuple[tuple[str, DevicePeak], ...] = (
    (r"\bh100\b.*\bnvl\b", DevicePeak("H100 NVL", 835.5e12, _H100 + " (BF16 1,671 TFLOPS with sparsity)")),
    (r"\bh100\b.*\bpcie\b", DevicePeak("H100 PCIe", 756.5e12,
                                      "NVIDIA H100 PCIe product brief PB-11133-001 and " + _H100
                                      + " (BF16 1,513 TFLOPS with sparsity)")),
    (r"\bh100\b", DevicePeak("H100 SXM", 989.5e12, _H100 + " (BF16 1,979 TFLOPS with sparsity)")),
    (r"\bh200\b.*\bnvl\b", DevicePeak("H200 NVL", 835.5e12, _H200 + " (BF16 1,671 TFLOPS with sparsity)")),
    (r"\bh200\b", DevicePeak("H200 SXM", 989.5e12, _H200 + " (BF16 1,979 TFLOPS with sparsity)")),
    (r"\ba100\b", DevicePeak("A100 (40/80 GB, SXM4 and PCIe)", 312e12,
                             "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-"
                             "datasheet-us-nvidia-1758950-r4-web.pdf (BF16 312 TFLOPS, 624 with sparsity)")),
    (r"\bl40s\b", DevicePeak("L40S", 362.05e12,
                             "https://www.nvidia.com/en-us/data-center/l40s/ (BF16 362.05 TFLOPS, 733 with sparsity)")),
)


def peak_for(device_name: str | None) -> DevicePeak | None:
    """The peak of the device NVML names ``device_name`` ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB",
    ...), or None for a device not in :data:`PEAKS` (and for None: the CPU)."""
    if not device_name:
        return None
    name = device_name.lower()
    for pattern, peak in PEAKS:
        if re.search(pattern, name):
            return peak
    return None


def mfu(flops_per_s: float, peak: DevicePeak | None, devices: int = 1) -> float | None:
    """``flops_per_s`` (all ``devices`` together) over their summed peak; None without a peak."""
    if peak is None or devices < 1:
        return None
    return flops_per_s / (peak.flops * devices)


def step_efficiency(model_flops: float, step_s: float, peak: DevicePeak | None, devices: int = 1
                    ) -> dict[str, float | None]:
    """The step record's fields: ``model_flops`` (all drafter ranks' items), ``flops_per_s`` (over the
    step's wall time) and ``mfu`` (per device, None on the CPU or an unknown device)."""
    per_s = model_flops / step_s if step_s > 0 else 0.0
    return {"model_flops": float(model_flops), "flops_per_s": per_s, "mfu": mfu(per_s, peak, devices)}


__all__ = ["PEAKS", "DevicePeak", "DrafterFlops", "StepCounts", "drafter_flops", "mfu", "peak_for",
           "step_efficiency", "train_flops"]
