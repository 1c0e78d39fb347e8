"""The drafter device's memory model counts what the implementation allocates: held against a real
CPU training step (fresh process, peak resident size), and its chunk and activation terms by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.loss_memory import MODEL_CASE, measure, model_prediction
from dflash.core.config import config_from_dict, load_config, with_overrides
from dflash.core.errors import ConfigError
from dflash.core.memory_model import activation_bytes, device_memory, logit_rows
from tests.test_split_memory import QWEN3_8B

QWEN3_8B_FULL = {**QWEN3_8B, "memory": {**QWEN3_8B["memory"], "intermediate_size": 12288, "kv_width": 1024}}


@pytest.mark.parametrize("case", [
    MODEL_CASE,
    {**MODEL_CASE, "checkpoint": True},
    dict(hidden=512, layers=3, heads=8, kv_heads=2, intermediate=1024, vocab=8000, seq_len=768, seqs=1, anchors=256,
         block=16, chunk=512, capture=3),
], ids=["activations-and-logits", "checkpointed-layers", "activation-bound-gqa"])
def test_the_model_is_within_25_percent_of_a_measured_cpu_training_step(case):
    """One forward, backward and AdamW step of a float32 drafter on the CPU: weights, gradients,
    optimizer state, the item's hidden states, the frozen tables, the logits chunk and the draft
    layers' activations together, against the process's peak resident size above its start."""
    got = measure("train", case)
    predicted = sum(model_prediction(case, got["params"]).values())
    assert predicted == pytest.approx(got["peak_above_start"], rel=0.25), (
        f"model {predicted / 2**20:.0f} MiB, measured {got['peak_above_start'] / 2**20:.0f} MiB")


def test_the_logits_term_is_one_chunk_not_the_item():
    cfg = config_from_dict(QWEN3_8B)
    assert logit_rows(cfg) == 8 * 512 * 15
    assert dict(device_memory(cfg)[1].parts)["logits chunk"] == 512 * 151936 * 10  # 10 B per entry: bf16 head
    small = with_overrides(cfg, {"drafter.loss_chunk_rows": 64})
    assert dict(device_memory(small)[1].parts)["logits chunk"] == 64 * 151936 * 10
    few = with_overrides(cfg, {"workload.seqs_per_item": 1, "drafter.anchors": 4, "drafter.loss_chunk_rows": 4096})
    assert dict(device_memory(few)[1].parts)["logits chunk"] == 4 * 15 * 151936 * 10  # fewer rows than a chunk


def test_activations_grow_with_layers_and_anchors_and_checkpointing_keeps_one_layer():
    cfg = config_from_dict(QWEN3_8B_FULL)
    one, five = (activation_bytes(with_overrides(cfg, {"drafter.layers": n})) for n in (1, 5))
    per_layer = (five - one) / 4
    assert per_layer > 0.15 * five  # each layer is a large share: the term the logits used to hide
    assert activation_bytes(with_overrides(cfg, {"drafter.anchors": 256})) < 0.6 * five
    ck = activation_bytes(with_overrides(cfg, {"drafter.checkpoint_layers": True}))
    q, d = 8 * 512 * 16, 4096
    assert ck == pytest.approx(one + 5 * q * d * 4, rel=1e-9)  # one layer's activations + every layer's input


def test_activations_are_not_counted_without_the_mlp_width_and_say_so():
    _, drafter = device_memory(config_from_dict(QWEN3_8B))
    assert "activations" not in dict(drafter.parts)
    assert any("memory.intermediate_size" in x for x in drafter.not_counted)


@pytest.mark.parametrize("name", ["h200-8b-drafter-bound.toml", "h200-target-bound.toml"])
def test_both_h200_examples_declare_their_sizes_and_fit_an_h200_with_10_percent_to_spare(name):
    """141 GB (131.3 GiB) with 10% to spare, as `dflash simulate` reports it: the model at the simulated
    peaks. (It was 105 GiB, 20% spare, before the CUDA context and the allocator's slack were counted.)"""
    from simulator.run import simulate
    from simulator.workload import make_sampler

    cfg = with_overrides(load_config(f"examples/{name}"), {"workload.lengths": "lognormal",
                                                            "workload.n_sequences": 4000})
    m = cfg.memory
    assert None not in (m.target_params, m.drafter_params, m.vocab_size, m.intermediate_size)
    sampler = make_sampler(cfg.workload, cfg.target.model, cfg.seed, cfg.drafter.block_size)
    peaks = simulate(cfg, sampler, sim_seconds=900).metrics
    devices = device_memory(cfg, producer_bytes=peaks.get("peak_producer_bytes"),
                            drafter_bytes=peaks.get("peak_drafter_bytes"))
    for dev in devices:
        assert not dev.not_counted
        assert dev.total <= 0.9 * 141e9, dev.describe()


def test_new_memory_keys_are_validated():
    for key, bad in (("intermediate_size", 0), ("kv_width", -1), ("activation_bytes", 0), ("attention_width", 1.5)):
        with pytest.raises(ConfigError, match=rf"memory\.{key}"):
            config_from_dict({"memory": {key: bad}})
    with pytest.raises(ConfigError, match=r"drafter\.checkpoint_layers"):
        config_from_dict({"drafter": {"checkpoint_layers": "yes"}})


@pytest.mark.slow
def test_the_model_holds_a_real_cpu_jobs_ranks(tmp_path):
    """Issue 33: a real 1 + 1 ``dflash train`` job on the CPU (benchmarks/rank_memory.py, the small shape), each
    rank's peak over its steps above its peak before the first, against the model's ``loop_bytes``. The
    larger terms are each over 15% of a rank's figure here (target: kernel code, weights paged in, capture
    forward, held items; drafter: kernel code, logits chunk, activations): leaving one out fails. Every
    term, the small ones too, is held by hand in tests/test_split_memory.py."""
    from benchmarks.rank_memory import run_shape

    got = run_shape("small", steps=4, plane=None, root=tmp_path)
    for role in ("target", "drafter"):
        ratio = got[role]["model"] / got[role]["measured"]
        # 15%, not the benchmark's 10%: the small target's figure (~18 MiB) moved by 2 MiB between runs
        # (17.2-19.5 MiB measured); the smallest term the bound guards, the paged-in weights, is 17% of it
        assert 0.85 <= ratio <= 1.15, (role, got[role])


def test_cpu_ranks_keep_glibcs_default_unless_asked_to_return_freed_memory(monkeypatch):
    """Returning freed memory at once costs a CPU target forward 1.09x and a drafter step up to 1.37x
    (benchmarks/freed_memory_cost.py, RESULTS.md), so a rank does it only when asked; rank_memory.py asks."""
    from dflash.pipeline.hostmem import RETURN_FREED_ENV, return_freed_memory

    monkeypatch.delenv(RETURN_FREED_ENV, raising=False)
    assert return_freed_memory() is False
    monkeypatch.setenv(RETURN_FREED_ENV, "0")
    assert return_freed_memory() is False
    assert RETURN_FREED_ENV in (Path(__file__).resolve().parents[1] / "benchmarks" / "rank_memory.py").read_text()
