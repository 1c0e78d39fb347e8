"""examples/gpu-smollm2-learning.toml, the GPU learning profile (issue #27 item 4): it loads and validates on
the CPU, it is upstream's drafter shape scaled to SmolLM2 with the held-out metric on and several epochs,
and the memory model (at the simulated queue peaks) fits the one H200 that its target and drafter share."""

from __future__ import annotations

import re
from pathlib import Path

from dflash.core.config import load_config, with_overrides
from dflash.core.memory_model import device_memory

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "examples" / "gpu-smollm2-learning.toml"
H200_BYTES = 141e9


def test_the_profile_loads_with_upstreams_shape_the_heldout_metric_and_several_epochs():
    cfg = load_config(PROFILE)
    assert cfg.target.model == "smollm2" and cfg.workload.dataset == "auto"  # the regenerated cache when present
    assert cfg.drafter.block_size == 16 and cfg.drafter.effective_gamma == 7 and cfg.drafter.layers == 5
    assert cfg.target.capture_layers == 5
    assert cfg.train.quality_every is not None and cfg.train.epochs is not None and cfg.train.epochs >= 2
    assert cfg.train.lr == 6e-4 and cfg.train.max_steps is None  # the epochs end the run
    assert (cfg.cluster.n_target, cfg.cluster.n_drafter) == (1, 1)
    text = PROFILE.read_text()
    limit = int(re.search(r"--limit (\d+)", text).group(1))  # the regeneration command it documents
    assert limit >= 5000
    assert "H200" in text and re.search(r"~[\d.]+ minutes end to end", text)  # the expected run time, derived


def test_the_memory_model_fits_one_h200_shared_by_the_target_and_the_drafter_rank():
    from simulator.run import simulate
    from simulator.workload import make_sampler

    cfg = with_overrides(load_config(PROFILE), {"workload.lengths": "lognormal", "workload.n_sequences": 4000,
                                                "workload.length_median": 400.0})
    sampler = make_sampler(cfg.workload, cfg.target.model, cfg.seed, cfg.drafter.block_size)
    peaks = simulate(cfg, sampler, sim_seconds=300).metrics
    target, drafter = device_memory(cfg, producer_bytes=peaks.get("peak_producer_bytes"),
                                    drafter_bytes=peaks.get("peak_drafter_bytes"))
    assert not target.not_counted and not drafter.not_counted
    assert target.total + drafter.total <= 0.8 * H200_BYTES, (target.describe(), drafter.describe())
    assert drafter.total > 1e9  # the logits chunk and activations are counted, not zero
