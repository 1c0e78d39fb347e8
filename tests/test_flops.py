"""The drafter's model FLOPs (dflash.model.flops): against a hand count, against torch's FlopCounterMode on a
real forward and backward, recomputation not counted; the device peak table by the names NVML reports."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from dflash.core.config import DrafterConfig
from dflash.model.attention import block_attention_mask
from dflash.model.drafter import DFlashDrafter, DrafterSpec
from dflash.model.flops import StepCounts, drafter_flops, mfu, peak_for, step_efficiency, train_flops
from dflash.model.target import HiddenStateCapture
from tests.tiny_models import tiny_llama

VOCAB = 256
LAYER_IDS = (1, 3)
MASK_ID = 4


def _spec(**kw) -> DrafterSpec:
    base = dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=256,
                target_layer_ids=(1, 3), mask_token_id=4, layers=2, block_size=8, anchors=4, attention="dense")
    return DrafterSpec(**{**base, **kw})


def test_the_formula_against_a_hand_count():
    """Every matmul of one item written out as (rows, inner, cols) with its backward multiple: fc (weight
    gradient only), per layer q, k, v, o, gate, up, down (x3), attention scores and values over the attended
    pairs (x3), the frozen LM head (input gradient only)."""
    spec = _spec()
    # One sequence of 30 real tokens; anchors at 5, 12, 20 (all valid): P = 5 + 12 + 20 = 37; R = 3 x 7 = 21.
    counts = StepCounts(context_tokens=30, blocks=3, context_seen=37, rows=21)
    q, kv_pos, pairs = 3 * 8, 30 + 3 * 8, 8 * (37 + 3 * 8)  # 24 queries, 54 keys, 488 attended pairs per head
    matmuls = [(30, 128, 64, 2)]  # fc: [T, K*d] @ [K*d, d]
    for _layer in range(2):
        matmuls += [(q, 64, 64, 3), (kv_pos, 64, 32, 3), (kv_pos, 64, 32, 3), (q, 64, 64, 3),  # q, k, v, o
                    (q, 64, 128, 3), (q, 64, 128, 3), (q, 128, 64, 3)]  # gate, up, down
        matmuls += [(pairs, 16, 4, 3), (pairs, 16, 4, 3)]  # per pair: 4 heads x head_dim 16, for QK^T and PV
    matmuls += [(21, 64, 256, 2)]  # LM head
    hand = sum(2 * m * k * n * mult for m, k, n, mult in matmuls)
    assert train_flops(spec, counts) == hand == 15_200_256  # 983,040 fc + 2 x 6,420,480 layers + 1,376,256 head
    parts = drafter_flops(spec, counts)
    assert parts.attention == 2 * 2 * (2 * pairs * 16 * 4) and parts.lm_head == 2 * 21 * 64 * 256


def _counted(drafter: DFlashDrafter, ctx, ids, lm, am, anchors) -> tuple[float, object]:
    """FlopCounterMode's count of one loss forward and backward (SDPA's math kernel: plain matmuls it counts)."""
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel([SDPBackend.MATH]):
        out = drafter.loss(ctx, ids, lm, am, anchors=anchors)
        out.loss_sum.backward()
    return float(counter.get_total_flops()), out


def test_the_formula_against_torchs_flop_counter_on_a_real_step():
    """No padding (two full 24-token rows, 3 valid anchors each, every slot counted), so FlopCounterMode and the
    model count the same matmuls except the attention: FlopCounterMode counts it dense, every (query, key)
    pair; the model only the pairs the mask lets through, a ratio taken from the dense mask itself."""
    target = tiny_llama(seed=1, dtype=torch.float32, vocab_size=VOCAB)
    spec = DrafterSpec.from_target_config(target.config, target_layer_ids=LAYER_IDS, mask_token_id=MASK_ID,
                                          drafter=DrafterConfig(layers=2, block_size=8, anchors=3,
                                                                attention="dense"))
    torch.manual_seed(0)
    drafter = DFlashDrafter.from_target(target, spec, dtype=torch.float32)
    b, s = 2, 24
    ids = torch.randint(5, VOCAB, (b, s), generator=torch.Generator().manual_seed(4))
    am, lm = torch.ones(b, s, dtype=torch.long), torch.ones(b, s, dtype=torch.bool)
    anchors = torch.tensor([[2, 7, 16], [0, 9, 12]])
    ctx = HiddenStateCapture(target, LAYER_IDS)(ids, am)
    counted, out = _counted(drafter, ctx, ids, lm, am, anchors)

    assert (out.anchors, out.tokens, out.context_seen) == (6, 6 * 7, 2 + 7 + 16 + 0 + 9 + 12)
    parts = drafter_flops(spec, StepCounts(b * s, out.anchors, out.context_seen, out.tokens))
    mask = block_attention_mask(anchors, s, 8, am.bool())
    attended, every = int(mask.sum()), mask.numel()
    h = spec.num_heads * spec.head_dim
    dense_attention = 3 * spec.layers * 2 * 2 * every * h  # forward + backward over every pair, all layers
    assert 3 * parts.attention == 3 * spec.layers * 2 * 2 * attended * h  # the model's: attended pairs only
    assert 3 * parts.attention * every / attended == pytest.approx(dense_attention, rel=1e-12)
    assert counted == parts.train - 3 * parts.attention + dense_attention  # all else exactly

    # recomputation (checkpoint_layers) runs (up to) the layers' forward again: torch counts it, the model
    # count, a function of the same counts, does not change (measured: 7.47 of 9.04 MFLOP recomputed here;
    # torch's checkpoint stops recomputing once the tensors the backward needs exist again)
    ck = DFlashDrafter.from_target(target, dataclasses.replace(spec, checkpoint_layers=True), dtype=torch.float32)
    ck.load_state_dict(drafter.state_dict())
    recounted, out_ck = _counted(ck, ctx, ids, lm, am, anchors)
    assert counted < recounted <= counted + parts.layers + dense_attention / 3
    assert (out_ck.anchors, out_ck.tokens, out_ck.context_seen) == (out.anchors, out.tokens, out.context_seen)


def test_padding_and_padding_anchors_are_not_model_flops():
    """The context a block sees counts real tokens only (left padding included), and padding anchors none."""
    target = tiny_llama(seed=1, dtype=torch.float32, vocab_size=VOCAB)
    spec = DrafterSpec.from_target_config(target.config, target_layer_ids=LAYER_IDS, mask_token_id=MASK_ID,
                                          drafter=DrafterConfig(layers=1, block_size=4, anchors=3, attention="dense"))
    drafter = DFlashDrafter.from_target(target, spec, dtype=torch.float32)
    s = 16
    ids = torch.randint(5, VOCAB, (2, s), generator=torch.Generator().manual_seed(2))
    am = torch.ones(2, s, dtype=torch.long)
    am[0, :3] = 0  # three pad tokens before row 0's text
    am[1, 10:] = 0  # row 1 ends at 10
    anchors, valid = torch.tensor([[5, 9, 11], [4, 6, 0]]), torch.tensor([[True, True, True], [True, True, False]])
    with torch.no_grad():
        out = drafter.loss(HiddenStateCapture(target, LAYER_IDS)(ids, am), ids, am.bool(), am, anchors=anchors,
                           anchor_valid=valid)
    assert out.anchors == 5 and out.context_seen == (5 - 3) + (9 - 3) + (11 - 3) + 4 + 6


def test_the_peak_table_by_the_names_nvml_reports():
    expect = {"NVIDIA H100 80GB HBM3": 989.5e12, "NVIDIA H100 PCIe": 756.5e12, "NVIDIA H100 NVL": 835.5e12,
              "NVIDIA H200": 989.5e12, "NVIDIA H200 NVL": 835.5e12, "NVIDIA A100-SXM4-80GB": 312e12,
              "NVIDIA A100-SXM4-40GB": 312e12, "NVIDIA A100-PCIE-40GB": 312e12, "NVIDIA A100 80GB PCIe": 312e12,
              "NVIDIA L40S": 362.05e12}
    for name, flops in expect.items():
        peak = peak_for(name)
        assert peak is not None and peak.flops == flops, name
        assert "nvidia.com" in peak.source and "with sparsity" in peak.source, name
    for unknown in ("NVIDIA L40", "NVIDIA GH200 480GB", "NVIDIA GeForce RTX 4090", "cpu", "", None):
        assert peak_for(unknown) is None, unknown


def test_mfu_is_achieved_over_peak_and_none_without_a_peak():
    h100 = peak_for("NVIDIA H100 80GB HBM3")
    assert mfu(494.75e12, h100) == pytest.approx(0.5)
    assert mfu(989.5e12, h100, devices=4) == pytest.approx(0.25)
    assert step_efficiency(2e12, 0.5, None) == {"model_flops": 2e12, "flops_per_s": 4e12, "mfu": None}
    rec = step_efficiency(989.5e12, 2.0, h100)
    assert rec["flops_per_s"] == 494.75e12 and rec["mfu"] == pytest.approx(0.5)


@pytest.mark.slow
def test_the_mfu_benchmark_runs_a_real_step_on_the_cpu(tmp_path):
    """benchmarks/drafter_mfu.py, the GPU measurement of the issue's MFU goal, on its tiny shape: the dense path
    only on the CPU, FLOP/s from the same formula, no MFU."""
    from tests.conftest import load_script

    bench = load_script(Path(__file__).resolve().parent.parent / "benchmarks" / "drafter_mfu.py")
    out = bench.main(["--shape", "tiny", "--steps", "2", "--warmup", "1", "--device", "cpu",
                      "--json", str(tmp_path / "r.json")])
    assert [r["attention"] for r in out] == ["dense"]
    r = out[0]
    assert r["model_flops"] > 0 and r["flops_per_s"] == pytest.approx(r["model_flops"] / r["step_s_median"])
    assert r["mfu"] is None and r["peak_memory_gib"] is None
    assert json.loads((tmp_path / "r.json").read_text()) == out
