"""Memory: the per-device model (numbers derived by hand), its pre-flight check and sweep
constraint, and a simulator whose own memory does not grow with simulated time."""

from __future__ import annotations

import gc
import math
import tracemalloc
from pathlib import Path

import pytest

from dflash.core.config import config_from_dict, with_overrides
from dflash.core.errors import ConfigError
from dflash.core.memory_model import (
    ALLOCATOR_SLACK,
    CUDA_CONTEXT_BYTES,
    GIB,
    POOL_BUFFERS,
    PROCESS_BYTES,
    check_fits,
    device_memory,
    per_device,
)
from dflash.core.runmetrics import run_metrics
from simulator.run import simulate
from simulator.stream import MAX_POINTS
from simulator.workload import make_sampler
from tuning.evaluate import Evaluator, constraint_values

# Qwen3-8B-like target, ~1B drafter, the H200 example's workload and queue.
QWEN3_8B = {
    "workload": {"lengths": "lognormal", "n_sequences": 2000, "seqs_per_item": 8, "max_len": 2048},
    "cluster": {"n_target": 4, "n_drafter": 4},
    "queue": {"min_ready": 30, "max_depth": 90},
    "target": {"capture_layers": 5},
    "drafter": {"anchors": 512, "block_size": 16},
    "timing": {"hidden_size": 4096, "dtype_bytes": 2},
    "memory": {"target_params": 8e9, "drafter_params": 1e9, "vocab_size": 151936},
}
ITEM = 8 * 2048 * 5 * 4096 * 2  # 671,088,640 bytes: 8 sequences x 2048 tokens x 40 KiB


def parts(dev) -> dict[str, float]:
    return dict(dev.parts)


def test_device_memory_by_hand() -> None:
    target, drafter = device_memory(config_from_dict(QWEN3_8B))
    t = parts(target)
    assert t["weights"] == 16e9  # 8e9 parameters x 2 bytes on one GPU
    assert t["hidden states"] == 90 / 4 * ITEM + ITEM  # an even share of 90 queued items + the one at the cap
    assert t["pooled buffers"] == 4 * ITEM  # the send pool: every drafter's take of one round (4 x 1)
    assert t["CUDA context"] == CUDA_CONTEXT_BYTES
    assert t["allocator slack"] == pytest.approx(ALLOCATOR_SLACK * (16e9 + 90 / 4 * ITEM + ITEM + 4 * ITEM))
    d = parts(drafter)
    # the gradients (2e9) beyond the loss chunk they replace in the backward
    assert (d["weights"], d["gradients"], d["optimizer"]) == (2e9, 2e9 - 512 * 151936 * 10, 12e9)
    assert d["hidden states"] == ITEM  # one item per take
    assert "pooled buffers" not in d  # a sharing plane: the drafter maps the producer's buffers
    assert d["frozen embedding and head"] == 2 * 151936 * 4096 * 2
    assert d["logits chunk"] == 512 * 151936 * 10  # one chunk of the loss, not 8 x 512 x 15 rows (issue #25)
    allocated = 16e9 - 512 * 151936 * 10 + ITEM + 2 * 151936 * 4096 * 2 + 512 * 151936 * 10
    assert drafter.total == pytest.approx(allocated * (1 + ALLOCATOR_SLACK) + CUDA_CONTEXT_BYTES)
    copying = parts(device_memory(config_from_dict(QWEN3_8B), sharing=False)[1])
    assert copying["pooled buffers"] == 1 * ITEM  # the receive pool on a copying plane: one take's item
    cpu = parts(device_memory(config_from_dict(QWEN3_8B), on_gpu=False)[1])
    assert "CUDA context" not in cpu and "allocator slack" not in cpu
    assert cpu["frozen embedding and head paged in"] == 2 * 151936 * 4096 * 2 and cpu["process"] == PROCESS_BYTES


# the "small" shape of benchmarks/rank_memory.py: d 128, 6 layers, H 128, KV 64, I 384, vocab 4000, 2 x 256 tokens
SMALL = {"workload": {"lengths": "lognormal", "n_sequences": 200, "seqs_per_item": 2, "max_len": 256,
                      "bucket_bounds": [256]},
         "cluster": {"n_target": 1, "n_drafter": 1}, "queue": {"min_ready": 2, "max_depth": 6},
         "target": {"capture_layers": 3}, "drafter": {"layers": 1, "block_size": 8, "anchors": 32},
         "timing": {"hidden_size": 128, "dtype_bytes": 4},
         "memory": {"target_params": 2 * 4000 * 128 + 128 + 6 * 196864, "drafter_params": 246336, "vocab_size": 4000,
                    "intermediate_size": 384, "attention_width": 128, "kv_width": 64, "weight_bytes": 4,
                    "optimizer_bytes_per_param": 8, "logits_bytes": 8, "activation_bytes": 4}}


def test_a_cpu_ranks_loop_counts_every_term_by_hand() -> None:
    """What a CPU rank's loop adds (the figure benchmarks/rank_memory.py measures), term by term: removing
    or changing any term of the model fails here."""
    from dflash.core.memory_model import (
        KERNEL_CODE_BYTES,
        activation_bytes,
        logits_chunk_bytes,
        loop_bytes,
        target_forward_bytes,
    )

    cfg = config_from_dict(SMALL)
    item = 2 * 256 * 3 * 128 * 4  # 786,432 bytes
    target, drafter = device_memory(cfg, on_gpu=False)
    per_layer = 2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 384 + 2 * 128  # 196,864: q o, k v, MLP, two norms
    assert parts(target) == {
        # unread: the head, the final norm, the embedding's other rows, layers 4-5
        "weights": (2 * 4000 * 128 - 512 * 128 + 128 + 2 * per_layer) * 4,
        "weights paged in": (512 * 128 + 4 * per_layer) * 4,  # the item's 512 embedding rows, layers 0-3 (deepest 3)
        "hidden states": 6 * item + item,  # the queue at its depth (one producer) + the item at the cap
        "pooled buffers": 1 * item,  # one drafter's take in flight
        "capture forward": target_forward_bytes(cfg),
        "kernel code": KERNEL_CODE_BYTES["target"], "process": PROCESS_BYTES}
    assert loop_bytes(target) == pytest.approx(sum(v for k, v in parts(target).items() if k not in ("weights",
                                                                                                     "process")))
    assert parts(drafter) == {
        # the gradients (0.9 MiB) fit in the loss chunk's 13.7 MiB, freed before the backward makes them
        "weights": 246336 * 4, "gradients": 0.0, "optimizer": 246336 * 8, "hidden states": item,
        "frozen embedding and head paged in": 2 * 4000 * 128 * 4, "logits chunk": logits_chunk_bytes(cfg),
        "activations": activation_bytes(cfg), "kernel code": KERNEL_CODE_BYTES["drafter"], "process": PROCESS_BYTES}
    assert logits_chunk_bytes(cfg) == 2 * 32 * 7 * 4000 * 8  # every row in one chunk, 8 B a float32 entry
    assert loop_bytes(drafter) == pytest.approx(drafter.total - 246336 * 4 - PROCESS_BYTES)


def test_sharded_targets_split_their_weights_not_their_hidden_states() -> None:
    cfg = config_from_dict({**QWEN3_8B, "cluster": {"n_target": 1, "n_drafter": 4, "gpus": 8, "gpus_per_target": 4}})
    t = parts(device_memory(cfg)[0])
    assert t["weights"] == 4e9 and t["hidden states"] == 90 * ITEM + ITEM


def test_unknown_sizes_are_not_counted_and_say_so() -> None:
    target, drafter = device_memory(config_from_dict({k: v for k, v in QWEN3_8B.items() if k != "memory"}))
    assert list(parts(target)) == ["hidden states", "pooled buffers", "CUDA context", "allocator slack"]
    assert "memory.target_params" in target.not_counted[0] and "memory.intermediate_size" in target.not_counted[1]
    assert list(parts(drafter)) == ["hidden states", "CUDA context", "allocator slack"]
    assert len(drafter.not_counted) == 3


def test_check_fits_refuses_in_one_line_with_the_numbers() -> None:
    cfg = config_from_dict({**QWEN3_8B, "memory": {**QWEN3_8B["memory"], "intermediate_size": 12288,
                                                   "kv_width": 1024}, "sweep": {"memory_budget_gib": 139.0}})
    with pytest.raises(ConfigError) as err:
        check_fits(cfg)
    line = str(err.value)
    need = device_memory(cfg)[1].total / GIB
    assert "\n" not in line and line.startswith(f"sweep.memory_budget_gib: the drafter device needs {need:.1f} GiB")
    assert "activations 172.9" in line and "optimizer 11.2" in line and "holds 139.0 GiB" in line
    assert "--force" in line
    check_fits(with_overrides(cfg, {"sweep.memory_budget_gib": 230.0}))  # fits: no error
    check_fits(with_overrides(cfg, {"drafter.anchors": 128}))  # a quarter of the activations fits in 139
    check_fits(config_from_dict({k: v for k, v in QWEN3_8B.items() if k != "sweep"}))  # no budget, no check
    check_fits(cfg, force=True)  # the one way past it


def test_roles_sharing_a_device_are_summed_and_the_devices_own_capacity_decides() -> None:
    """One shared GPU (a target and a drafter rank on cuda:0) needs both roles' bytes; the capacity is the
    device's own, and the configured budget is not used where a capacity is given."""
    cfg = config_from_dict({**QWEN3_8B, "sweep": {"memory_budget_gib": 1.0}})
    t, d = device_memory(cfg)
    shared = [("target", "cuda:0"), ("drafter", "cuda:0")]
    check_fits(cfg, shared, {"cuda:0": t.total + d.total + 1})  # fits the device (the 1 GiB budget is not used)
    with pytest.raises(ConfigError) as err:
        check_fits(cfg, shared, {"cuda:0": t.total + d.total - 1})  # each alone would fit: together they do not
    line = str(err.value)
    assert "\n" not in line and f"cuda:0 needs {(t.total + d.total) / GIB:.1f} GiB" in line
    assert "target " in line and "drafter " in line and "holds" in line
    host = per_device(cfg, shared)[1]  # the GPU ranks' host RAM: each process, the drafter's host tables
    assert host.device == "host" and dict(host.roles[0].parts) == {"process": PROCESS_BYTES}
    assert dict(host.roles[1].parts) == {"process": PROCESS_BYTES, "frozen embedding and head": 2 * 151936 * 4096 * 2}
    with pytest.raises(ConfigError, match="host needs"):
        check_fits(cfg, shared, {"cuda:0": t.total + d.total + 1, "host": host.total - 1})
    cpu = [("target", "cpu"), ("drafter", "cpu"), ("drafter", "cpu")]
    need = per_device(cfg, cpu)[0]
    assert need.device == "cpu" and len(need.roles) == 3
    assert all("CUDA context" not in dict(r.parts) for r in need.roles)
    assert need.total == pytest.approx(device_memory(cfg, on_gpu=False)[0].total
                                       + 2 * device_memory(cfg, on_gpu=False)[1].total)


def test_the_pool_size_is_the_transports() -> None:
    from dflash.pipeline import transport

    assert transport.POOL_BUFFERS == POOL_BUFFERS


def test_the_sweep_constraint_uses_the_simulated_peaks_per_device() -> None:
    """Drafter-bound: the queue sits at max_depth, so each of 4 producers holds ~max_depth / 4 items."""
    small = {**QWEN3_8B, "memory": {"target_params": 8e9}, "timing": {**QWEN3_8B["timing"],
             "target_noise": "deterministic", "drafter_noise": "deterministic"}, "sweep": {"seeds_per_trial": 1}}
    cfg = config_from_dict(small)
    ev = Evaluator(cfg, sim_seconds=900).evaluate(cfg.queue)
    held = ev.worst("peak_producer_bytes")
    assert 90 / 4 * ITEM * 0.8 <= held <= 90 * ITEM  # lengths vary: items are at most ITEM
    target = (16e9 + held + POOL_BUFFERS * ITEM) * (1 + ALLOCATOR_SLACK) + CUDA_CONTEXT_BYTES
    assert ev.worst("peak_device_bytes") == pytest.approx(target)  # the target device is the fullest
    budget = target / GIB
    assert constraint_values(ev, with_overrides(cfg, {"sweep.memory_budget_gib": budget * 1.01}), None)["memory"] < 0
    assert constraint_values(ev, with_overrides(cfg, {"sweep.memory_budget_gib": budget * 0.99}), None)["memory"] > 0


FAST = {"workload": {"lengths": "lognormal", "n_sequences": 3000, "seqs_per_item": 4},
        "timing": {"target_per_token_s": 2e-5, "drafter_per_anchor_s": 1e-4}, "metrics": {"warmup_s": 60.0}}


ROOT = Path(__file__).resolve().parent.parent
# The sampler's formed epochs are a bounded cache (dflash.core.sampler.EPOCH_CACHE epochs, whatever the run
# length; benchmarks/sim_memory.py measures the whole process): left out, so what is measured is the simulation's.
OURS = [tracemalloc.Filter(True, str(ROOT / "simulator" / "*")),
        tracemalloc.Filter(True, str(ROOT / "dflash" / "core" / "*")),
        tracemalloc.Filter(True, "*/simpy/*"), tracemalloc.Filter(False, str(ROOT / "dflash" / "core" / "sampler.py"))]


def live_bytes(cfg, sampler, seconds: float, **kw) -> tuple[int, object]:
    """The most memory the simulation's own code (simulator, dflash.core, SimPy) holds at five points
    of the run. Snapshots are filtered by file, so allocations of other threads in the test process
    (left by other tests, running other dflash packages) do not count, and each follows a full
    collection: cyclic garbage the collector has not reached yet is not live memory, and how much of
    it is pending depends on what the tests before this one allocated (CI measured 1.56x that way
    once, inside the full suite, where alone it is 1.08x)."""
    sizes: list[int] = []
    calls = [0]

    def probe(_: float) -> None:
        calls[0] += 1
        if calls[0] % 40 == 0:
            gc.collect()
            snap = tracemalloc.take_snapshot().filter_traces(OURS)
            sizes.append(sum(st.size for st in snap.statistics("filename")))

    tracemalloc.start()
    try:
        res = simulate(cfg, sampler, sim_seconds=seconds, progress=probe, **kw)
    finally:
        tracemalloc.stop()
    return max(sizes), res


def test_a_long_simulation_keeps_no_events_unless_records_are_asked_for() -> None:
    cfg = config_from_dict(FAST)
    sampler = make_sampler(cfg.workload, seed=0)
    # Form the first epochs once, so neither measured run pays for them.
    simulate(cfg, sampler, sim_seconds=1000)
    # Both measured runs are long enough that the plotted series are within 2x of their MAX_POINTS bound:
    # between the two they can add at most ~60 kB (500 depth points, ~300 windows) to a ~250 kB base,
    # while per-event state of only 10 bytes would add ~300 kB over the 30,000 extra events. (Against
    # a 100 s run the series themselves grew 1.45-1.6x, the size of the bound, and the check was noise.)
    base_bytes, base = live_bytes(cfg, sampler, 1000)
    long_bytes, long = live_bytes(cfg, sampler, 3000)
    assert long.summary["produced"] > 2.5 * base.summary["produced"]
    assert not long.trace.produce_rows and not long.trace.take_rows
    with pytest.raises(ValueError, match="keep_records=True"):
        _ = long.take  # no silent empty list
    assert long_bytes < 1.5 * base_bytes  # flat: 3x the events, not 3x the memory
    assert len(long.series["depth"]) <= MAX_POINTS and len(long.series["windows"]) <= MAX_POINTS
    kept_bytes, kept = live_bytes(cfg, sampler, 1000, keep_records=True)
    assert len(kept.trace.produce_rows) == sum(1 for _ in kept.trace.produce_records()) > 0
    assert kept_bytes > 3 * base_bytes  # records are what grew


@pytest.mark.parametrize("overrides", [
    {},
    {"queue.policy": "proportional", "queue.items_per_take": 3, "queue.gate": "hysteresis"},
    {"cluster.drafter_sync": "none", "cluster.n_target": 1, "timing.target_noise": "deterministic",
     "timing.drafter_noise": "deterministic"},
])
def test_streamed_metrics_equal_run_metrics_over_the_records(overrides: dict) -> None:
    cfg = with_overrides(config_from_dict(FAST), overrides)
    res = simulate(cfg, make_sampler(cfg.workload, seed=0), sim_seconds=1200, keep_records=True)
    ref = run_metrics(res.trace, p=res.item_mix, min_ready=cfg.queue.min_ready, window=cfg.metrics.window,
                      warmup_s=cfg.metrics.warmup_s, close_t=1200, n_target=cfg.cluster.n_target,
                      n_drafter=cfg.cluster.n_drafter, n_buckets=len(res.item_mix),
                      open_intervals=res.summary["open_intervals"])
    assert ref["steady_state_reached"]
    for key, want in ref.items():
        got = res.metrics[key]
        if isinstance(want, list):
            assert got == pytest.approx(want, rel=1e-9, abs=1e-9), key
        elif isinstance(want, float) and math.isnan(want):
            assert math.isnan(got), key
        else:
            assert got == pytest.approx(want, rel=1e-9, abs=1e-9), key


@pytest.mark.slow
def test_sim_memory_reports_the_childs_own_peak_not_its_parents(tmp_path: Path) -> None:
    """benchmarks/sim_memory.py's child reads its own VmHWM: a parent holding 700 MB more than the child
    ever needs does not show up as the child's peak (``ru_maxrss`` carried the parent's size over exec)."""
    from tests.conftest import load_script

    sim_memory = load_script(ROOT / "benchmarks" / "sim_memory.py")
    ballast = bytearray(700 * 2**20)  # touched: resident in this (the parent) process
    ballast[::4096] = b"\x01" * len(ballast[::4096])
    with open("/proc/self/status") as f:
        parent_mb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    res = sim_memory.run(sim_memory.EXAMPLE, 60.0, tmp_path / "m.json")
    del ballast
    assert 0 < res["peak_mb"] < parent_mb - 500, (res, parent_mb)
