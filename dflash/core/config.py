"""The configuration file of docs/ARCHITECTURE.md as frozen dataclasses, validated once.

One TOML file with the sections ``workload``, ``cluster``, ``queue``, ``target``, ``drafter``,
``train``, ``metrics`` and ``sweep``. Flags override file values through :func:`with_overrides`,
which rebuilds the dataclasses so the same validation runs on every value whatever its origin.
Unknown sections and keys are errors: a typo must not silently fall back to a default.

This module is torch-free: the simulator and the sweep import it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dflash.core.errors import ConfigError
from dflash.core.links import DEFAULT_LINKS, LINK_KEYS, TIER_DEVICE, TIER_KEYS, TIER_NETWORK, TIER_NODE, links_of
from dflash.core.schedule import Schedule, schedule_for

POLICIES = ("fullest", "fifo", "random_item", "random_bucket", "proportional")
GATES = ("threshold", "hysteresis")
ORDERS = ("random", "length_grouped", "sorted")
SAMPLES = ("conversation", "first_exchange")
DATASET_AUTO = "auto"  # the target's regenerated replies if cached, else the packaged ShareGPT
DATASET_PACKAGED = "sharegpt"  # the packaged ShareGPT file, exactly
DATASET_NAMES = (DATASET_AUTO, DATASET_PACKAGED)
DRAFTER_SYNCS = ("step", "none")
SWEEP_SAMPLERS = ("nsga2", "tpe", "grid")
QUEUE_MODES = ("static", "auto")  # auto: dflash.core.autopilot moves min_ready/max_depth

# Flags that alias file keys; the CLI uses this to name both in error lines.
FLAG_FOR_KEY = {
    "queue.min_ready": "--hs-min-ready",
    "queue.max_depth": "--hs-max-depth",
    "queue.max_bytes": "--hs-max-bytes",
    "queue.policy": "--policy",
    "queue.gate": "--gate",
    "queue.items_per_take": "--items-per-take",
    "queue.mode": "--queue",
    "queue.target_mix_efficiency": "--target-mix",
}


# --------------------------------------------------------------------------- value checks
def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_int(key: str, v: object, lo: int | None = None, hi: int | None = None) -> int:
    """An integer within [lo, hi]; the message states the range that was required."""
    rng = _range_text(lo, hi)
    if not _is_int(v):
        raise ConfigError(key, f"must be an integer {rng}".rstrip(), v)
    assert isinstance(v, int)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ConfigError(key, f"must be an integer {rng}", v)
    return v


def check_float(key: str, v: object, lo: float | None = None, hi: float | None = None,
                *, lo_open: bool = False) -> float:
    ok_type = (isinstance(v, (int, float)) and not isinstance(v, bool)
               and math.isfinite(float(v)))  # type: ignore[arg-type]
    lo_txt = f"> {lo}" if lo_open else f">= {lo}"
    parts = [p for p in ((lo_txt if lo is not None else ""), (f"<= {hi}" if hi is not None else "")) if p]
    rng = " and ".join(parts)
    if not ok_type:
        raise ConfigError(key, f"must be a number {rng}".rstrip(), v)
    f = float(v)  # type: ignore[arg-type]
    if lo is not None and (f <= lo if lo_open else f < lo):
        raise ConfigError(key, f"must be a number {rng}", v)
    if hi is not None and f > hi:
        raise ConfigError(key, f"must be a number {rng}", v)
    return f


def check_choice(key: str, v: object, choices: tuple[str, ...]) -> str:
    if not isinstance(v, str) or v not in choices:
        raise ConfigError(key, f"must be one of {', '.join(choices)}", v)
    return v


def _range_text(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f"in [{lo}, {hi}]"
    if lo is not None:
        return f">= {lo}"
    if hi is not None:
        return f"<= {hi}"
    return ""


# --------------------------------------------------------------------------- sections
@dataclass(frozen=True)
class WorkloadConfig:
    """What the target reads and how the sampler turns sequences into queue items."""

    # "auto": the target's regenerated replies when `dflash regenerate` has cached them, else the packaged
    # ShareGPT; "sharegpt": the packaged file; else a path to JSON/JSONL (dflash.data.dataset_choice).
    dataset: str = "sharegpt"
    sample: str = "conversation"
    max_len: int = 2048
    bucket_bounds: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    seqs_per_item: int | None = 8
    tokens_per_item: int | None = None
    order: str = "length_grouped"
    mega_batch: int = 64
    max_conversations: int | None = None  # a prefix of the data set, for short runs and tests
    # Where the simulator gets sequence lengths: "dataset" (the data set above, tokenised and
    # cached), "lognormal" (length_median, length_sigma, n_sequences), or a path to a lengths file
    # (a JSON list of lengths) or histogram file ({"bins": [[lo, hi, count], ...]}).
    lengths: str = "dataset"
    length_median: float = 1800.0
    length_sigma: float = 0.6
    n_sequences: int = 20000
    # Content fingerprint of the file a run trained on (set when a run pins its data; a changed file is refused).
    dataset_fingerprint: str | None = None

    def __post_init__(self) -> None:
        if (not isinstance(self.dataset, str) or not self.dataset or (
                self.dataset not in DATASET_NAMES and Path(self.dataset).suffix.lower() not in (".json", ".jsonl"))):
            raise ConfigError("workload.dataset", "must be 'auto', 'sharegpt' or a path to a .json/.jsonl file",
                              self.dataset)
        if self.dataset_fingerprint is not None and (not isinstance(self.dataset_fingerprint, str) or not re.fullmatch(
                r"[0-9a-f]{16}", self.dataset_fingerprint)):
            raise ConfigError("workload.dataset_fingerprint", "must be 16 hex digits (written by dflash train)",
                              self.dataset_fingerprint)
        check_choice("workload.sample", self.sample, SAMPLES)
        check_int("workload.max_len", self.max_len, 1)
        bounds = self.bucket_bounds
        if (not isinstance(bounds, (list, tuple)) or not bounds
                or not all(_is_int(b) and b >= 1 for b in bounds)):
            raise ConfigError("workload.bucket_bounds", "must be a non-empty list of positive integers",
                              bounds)
        if any(b2 <= b1 for b1, b2 in itertools.pairwise(bounds)):
            raise ConfigError("workload.bucket_bounds", "must be strictly increasing", list(bounds))
        if bounds[-1] != self.max_len:
            raise ConfigError("workload.bucket_bounds",
                              f"last bound must equal workload.max_len = {self.max_len}", list(bounds))
        object.__setattr__(self, "bucket_bounds", tuple(bounds))
        if (self.seqs_per_item is None) == (self.tokens_per_item is None):
            raise ConfigError("workload.seqs_per_item",
                              "set exactly one of seqs_per_item and tokens_per_item",
                              (self.seqs_per_item, self.tokens_per_item))
        if self.seqs_per_item is not None:
            check_int("workload.seqs_per_item", self.seqs_per_item, 1)
        if self.tokens_per_item is not None:
            check_int("workload.tokens_per_item", self.tokens_per_item, self.max_len)
        check_choice("workload.order", self.order, ORDERS)
        check_int("workload.mega_batch", self.mega_batch, 1)
        if self.max_conversations is not None:
            check_int("workload.max_conversations", self.max_conversations, 1)
        if not isinstance(self.lengths, str) or not self.lengths:
            raise ConfigError("workload.lengths",
                              "must be 'dataset', 'lognormal' or a path to a lengths file", self.lengths)
        if self.lengths not in ("dataset", "lognormal") and not Path(self.lengths).is_file():
            raise ConfigError("workload.lengths",
                              "must be 'dataset', 'lognormal' or an existing lengths/histogram file",
                              self.lengths)
        check_float("workload.length_median", self.length_median, 1.0)
        check_float("workload.length_sigma", self.length_sigma, 0.0)
        check_int("workload.n_sequences", self.n_sequences, 1)


@dataclass(frozen=True)
class ClusterConfig:
    """Who runs where. ``gpus`` is the GPU budget a split sweep shares out (``n_target`` target
    workers of ``gpus_per_target`` GPUs each, the rest drafters); ``gpus_per_target`` > 1 (a target
    sharded over several GPUs) is simulator-only until the trainer shards targets
    (:meth:`check_trainable`). Ranks fill nodes of ``gpus_per_node`` in order, targets first: that
    decides which hidden-state moves cross nodes. ``shared_device`` puts every rank of a node on the
    node's one device (the CPU, or a node's one GPU, as the trainer places them there). The three
    ``*_link`` keys name what a move costs in each tier when ``[timing]`` does not set it
    (:mod:`dflash.core.links`: same device, same node, across nodes)."""

    n_target: int = 4
    n_drafter: int = 4
    drafter_sync: str = "step"
    gpus: int | None = None
    gpus_per_target: int = 1
    gpus_per_node: int = 8
    shared_device: bool = False
    device_link: str = DEFAULT_LINKS[TIER_DEVICE]
    node_link: str = DEFAULT_LINKS[TIER_NODE]
    network_link: str = DEFAULT_LINKS[TIER_NETWORK]

    def __post_init__(self) -> None:
        check_int("cluster.n_target", self.n_target, 1)
        check_int("cluster.n_drafter", self.n_drafter, 1)
        check_choice("cluster.drafter_sync", self.drafter_sync, DRAFTER_SYNCS)
        check_int("cluster.gpus_per_target", self.gpus_per_target, 1)
        check_int("cluster.gpus_per_node", self.gpus_per_node, 1)
        if not isinstance(self.shared_device, bool):
            raise ConfigError("cluster.shared_device", "must be true or false", self.shared_device)
        for tier, key in LINK_KEYS.items():
            check_choice(f"cluster.{key}", getattr(self, key), links_of(tier))
        if self.gpus is not None:
            check_int("cluster.gpus", self.gpus, self.gpus_per_target + 1)
            used = self.n_target * self.gpus_per_target + self.n_drafter
            if used > self.gpus:
                raise ConfigError("cluster.n_drafter", f"n_target x gpus_per_target + n_drafter = {used} must be "
                                  f"<= cluster.gpus = {self.gpus}", self.n_drafter)

    def check_trainable(self) -> None:
        """The real trainer runs one device per target worker: refuse a sharded target (one line)."""
        if self.gpus_per_target != 1:
            raise ConfigError("cluster.gpus_per_target", "must be 1 for train and validate: a target sharded "
                              "over several GPUs is simulator-only for now", self.gpus_per_target)


@dataclass(frozen=True)
class QueueConfig:
    """The knobs of docs/ARCHITECTURE.md's queue semantics; valid configs cannot deadlock.

    ``mode = "auto"`` hands ``min_ready``/``max_depth`` to the autopilot
    (:mod:`dflash.core.autopilot`): it starts from the configured pair and moves them between takes
    to hold the rolling ``mix_efficiency`` at ``target_mix_efficiency`` with the least queued memory,
    never below ``auto_min_ready`` nor above ``auto_max_depth`` (None: the configured ``max_depth``),
    nor past ``max_bytes``. ``"static"`` (the default) leaves them where they are set.
    """

    min_ready: int = 30
    max_depth: int = 90
    max_bytes: int | None = None
    policy: str = "random_item"
    gate: str = "threshold"
    items_per_take: int = 1
    mode: str = "static"
    target_mix_efficiency: float = 0.95
    auto_min_ready: int = 1
    auto_max_depth: int | None = None

    def __post_init__(self) -> None:
        check_int("queue.max_depth", self.max_depth, 1)
        check_int("queue.min_ready", self.min_ready, 1, self.max_depth)
        if self.max_bytes is not None:
            check_int("queue.max_bytes", self.max_bytes, 1)
        check_choice("queue.policy", self.policy, POLICIES)
        check_choice("queue.gate", self.gate, GATES)
        check_int("queue.items_per_take", self.items_per_take, 1)
        check_choice("queue.mode", self.mode, QUEUE_MODES)
        check_float("queue.target_mix_efficiency", self.target_mix_efficiency, 0.0, 1.5, lo_open=True)
        check_int("queue.auto_min_ready", self.auto_min_ready, 1, self.min_ready)
        if self.auto_max_depth is not None:
            check_int("queue.auto_max_depth", self.auto_max_depth, self.max_depth)

    @property
    def depth_limit(self) -> int:
        """The largest max_depth the autopilot may set."""
        return self.max_depth if self.auto_max_depth is None else self.auto_max_depth


def default_gamma(block_size: int) -> float:
    """DFlash's published loss decay: 7 for B=16, 5 for B=10, 4 for B=8; else B/16*7 rounded."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, round(7.0 * block_size / 16, 2))


@dataclass(frozen=True)
class TargetConfig:
    model: str = "smollm2"  # "smollm2" = the packaged GGUF; else a local dir, hub id or .gguf
    devices: tuple[str, ...] = ("cpu",)
    capture_layers: int = 5

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("target.model", "must be 'smollm2', a directory, a hub id or a .gguf path",
                              self.model)
        _check_devices("target.devices", self.devices)
        object.__setattr__(self, "devices", tuple(self.devices))
        check_int("target.capture_layers", self.capture_layers, 1)


@dataclass(frozen=True)
class DrafterConfig:
    layers: int = 5
    block_size: int = 16
    anchors: int = 512
    gamma: float | None = None  # None = default_gamma(block_size)
    devices: tuple[str, ...] = ("cpu",)
    # LM-head rows per chunk of the loss: the loss holds [chunk, vocab] logits at a time instead of
    # [rows, vocab] (dflash.model.chunked_ce); it bounds memory and leaves the result unchanged.
    loss_chunk_rows: int = 512
    # Recompute each draft layer's forward in the backward (torch.utils.checkpoint): an item keeps one
    # layer's activations instead of every layer's, for about one more forward of the draft layers.
    checkpoint_layers: bool = False
    # How the draft layers apply their attention mask (dflash.model.attention): "dense" (a boolean mask for
    # SDPA: the reference, runs everywhere), "flex" (a flex_attention block mask: masked tiles skipped, no
    # bias kept, k/v not copied per head; CUDA only, torch has no flex backward on the CPU) or "auto"
    # (flex on CUDA, dense on the CPU). Speed and memory, not the result.
    attention: str = "auto"

    def __post_init__(self) -> None:
        check_int("drafter.layers", self.layers, 1)
        check_choice("drafter.attention", self.attention, ("auto", "dense", "flex"))
        if not isinstance(self.checkpoint_layers, bool):
            raise ConfigError("drafter.checkpoint_layers", "must be true or false", self.checkpoint_layers)
        check_int("drafter.block_size", self.block_size, 2)
        check_int("drafter.anchors", self.anchors, 1)
        check_int("drafter.loss_chunk_rows", self.loss_chunk_rows, 1)
        if self.gamma is not None:
            check_float("drafter.gamma", self.gamma, 0.0, lo_open=True)
        _check_devices("drafter.devices", self.devices)
        object.__setattr__(self, "devices", tuple(self.devices))
        if self.attention == "flex" and "cpu" in self.devices:
            raise ConfigError("drafter.attention", "flex needs CUDA drafter devices (torch's flex_attention has no"
                              " backward on the CPU); use auto or dense", self.attention)

    @property
    def effective_gamma(self) -> float:
        return self.gamma if self.gamma is not None else default_gamma(self.block_size)


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and stopping. The learning-rate schedule (:mod:`dflash.core.schedule`) follows the
    run's end: ``max_steps`` (or ``schedule_steps``, the planned length when it is longer) and/or
    ``max_minutes`` of training time, whichever comes first. ``schedule`` is ``"wsd"`` (warm-up,
    stable, decay over the last ``decay_frac``; the default, reported better than cosine for DFlash)
    or ``"cosine"``; both end at ``min_lr_ratio`` x ``lr``."""

    lr: float = 6e-4
    warmup_ratio: float = 0.04
    schedule: str = "wsd"
    decay_frac: float = 0.2
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    max_steps: int | None = None
    max_minutes: float | None = None
    checkpoint_every: int = 100
    epochs: int | None = None  # None: epoch after epoch until max_steps / max_minutes
    schedule_steps: int | None = None
    cpu_threads: int | None = None  # intra-op threads per role thread on the CPU (None: cores // roles)
    log_every: int = 10
    eval_every: int | None = None  # acceptance length on held-out prompts every N steps (None: off)
    eval_prompts: int = 4
    eval_new_tokens: int = 48
    # The held-out quality metric (dflash.model.heldout): every N steps the drafter scores a fixed set of
    # sequences (quality_per_bucket per length bucket, chosen by seed and never trained on) at
    # quality_anchors fixed blocks each. None: off, and no sequence is held out.
    quality_every: int | None = None
    quality_per_bucket: int = 16
    quality_anchors: int = 32
    # The held-out set's own seed (None: the run's seed). A validation's extra training seeds
    # (``dflash validate --seeds``) keep this at the base seed, so every seed of every configuration
    # scores the same sequences (a paired comparison) and shares one copy of the target's states.
    quality_seed: int | None = None

    def __post_init__(self) -> None:
        if self.eval_every is not None:
            check_int("train.eval_every", self.eval_every, 1)
        if self.quality_every is not None:
            check_int("train.quality_every", self.quality_every, 1)
        check_int("train.quality_per_bucket", self.quality_per_bucket, 1)
        check_int("train.quality_anchors", self.quality_anchors, 1)
        if self.quality_seed is not None:
            check_int("train.quality_seed", self.quality_seed, 0)
        check_int("train.eval_prompts", self.eval_prompts, 1)
        check_int("train.eval_new_tokens", self.eval_new_tokens, 1)
        if self.epochs is not None:
            check_int("train.epochs", self.epochs, 1)
        if self.schedule_steps is not None:
            check_int("train.schedule_steps", self.schedule_steps, 1)
        if self.cpu_threads is not None:
            check_int("train.cpu_threads", self.cpu_threads, 1)
        check_int("train.log_every", self.log_every, 1)
        check_float("train.lr", self.lr, 0.0, lo_open=True)
        check_float("train.warmup_ratio", self.warmup_ratio, 0.0, 1.0)
        check_float("train.grad_clip", self.grad_clip, 0.0, lo_open=True)
        if self.max_steps is not None:
            check_int("train.max_steps", self.max_steps, 1)
        if self.max_minutes is not None:
            check_float("train.max_minutes", self.max_minutes, 0.0, lo_open=True)
        check_int("train.checkpoint_every", self.checkpoint_every, 1)
        self.lr_schedule()  # shape, decay_frac, min_lr_ratio, and no schedule that ends before max_steps

    def lr_schedule(self) -> Schedule:
        """The schedule of this run's limits (validated here, built by both trainers from here)."""
        return schedule_for(shape=self.schedule, max_steps=self.max_steps, schedule_steps=self.schedule_steps,
                            max_minutes=self.max_minutes, warmup_ratio=self.warmup_ratio,
                            decay_frac=self.decay_frac, min_ratio=self.min_lr_ratio)


@dataclass(frozen=True)
class MetricsConfig:
    window: int = 32
    warmup_s: float = 0.0

    def __post_init__(self) -> None:
        check_int("metrics.window", self.window, 2)
        check_float("metrics.warmup_s", self.warmup_s, 0.0)


SWEEP_MODES = ("pareto", "scalar")
DEFAULT_GRID_PAIRS = ((10, 30), (20, 60), (25, 75), (30, 90), (40, 120))


@dataclass(frozen=True)
class SweepConfig:
    """Study settings. ``space`` (the search space) is validated by ``tuning.space``.

    ``mode = "pareto"`` maximises throughput and mix_efficiency together; ``"scalar"`` maximises
    mix_efficiency subject to throughput >= ``min_throughput_frac`` x a reference measured before
    the study (the largest queue in the space with min-ready 1).
    """

    memory_budget_gib: float | None = None  # per device: the memory model's fullest device within this
    seeds_per_trial: int = 3
    sampler: str = "nsga2"
    top_k: int = 3
    space: dict[str, Any] = field(default_factory=dict)
    trials: int = 100
    sim_seconds: float = 3600.0  # simulated seconds per seed of a trial
    mode: str = "pareto"
    min_throughput_frac: float = 0.95
    max_gate_wait_frac: float = 0.9  # constraint: drafters wait at the gate at most this share
    grid_pairs: tuple[tuple[int, int], ...] = DEFAULT_GRID_PAIRS
    grid_policies: tuple[str, ...] = POLICIES

    def __post_init__(self) -> None:
        if self.memory_budget_gib is not None:
            check_float("sweep.memory_budget_gib", self.memory_budget_gib, 0.0, lo_open=True)
        check_int("sweep.seeds_per_trial", self.seeds_per_trial, 1)
        check_choice("sweep.sampler", self.sampler, SWEEP_SAMPLERS)
        check_int("sweep.top_k", self.top_k, 1)
        if not isinstance(self.space, dict):
            raise ConfigError("sweep.space", "must be a table", self.space)
        check_int("sweep.trials", self.trials, 1)
        check_float("sweep.sim_seconds", self.sim_seconds, 0.0, lo_open=True)
        check_choice("sweep.mode", self.mode, SWEEP_MODES)
        check_float("sweep.min_throughput_frac", self.min_throughput_frac, 0.0, 1.0, lo_open=True)
        check_float("sweep.max_gate_wait_frac", self.max_gate_wait_frac, 0.0, 1.0, lo_open=True)
        pairs = self.grid_pairs
        if (not isinstance(pairs, (list, tuple)) or not pairs or not all(
                isinstance(p, (list, tuple)) and len(p) == 2 and all(_is_int(x) for x in p)
                and 1 <= p[0] <= p[1] for p in pairs)):
            raise ConfigError("sweep.grid_pairs", "must be a list of [min_ready, max_depth] pairs with "
                              "1 <= min_ready <= max_depth", pairs)
        object.__setattr__(self, "grid_pairs", tuple(tuple(p) for p in pairs))
        if not isinstance(self.grid_policies, (list, tuple)) or not self.grid_policies:
            raise ConfigError("sweep.grid_policies", f"must be a non-empty list of {', '.join(POLICIES)}",
                              self.grid_policies)
        for pol in self.grid_policies:
            check_choice("sweep.grid_policies", pol, POLICIES)
        object.__setattr__(self, "grid_policies", tuple(self.grid_policies))


@dataclass(frozen=True)
class DecisionConfig:
    """How validation decides (:mod:`tuning.validation.decision`): the margins, the level, the gap test.

    A margin is the smallest difference the user cares about on that objective: two configurations
    whose interval of difference lies inside +-margin on every objective are *equivalent*, and the
    cheaper in queue memory wins. ``margin_throughput`` is a fraction of the reference's throughput;
    the others are in their objective's unit. ``level`` is the confidence of the whole decision (split
    over looks x comparisons x objectives); ``z_refute``: a gap between the simulated and measured
    differences larger than this many standard errors on any comparison refutes the simulator for the
    whole decision (the hardware then decides alone). The defaults (the smallest margins and the
    threshold that meet the decision's goals at the demo's one-round budget) come from
    ``benchmarks/decision_oc.py`` (docs/ARCHITECTURE.md, "Decisions: the validated simulator plus the hardware").
    """

    margin_throughput: float = 0.15
    margin_mix_efficiency: float = 0.05
    margin_heldout_tau: float = 0.02
    margin_heldout_loss: float = 0.2
    level: float = 0.95
    z_refute: float = 2.5  # benchmarks/decision_oc.py on the simulator with the training reference's anchor rule

    def __post_init__(self) -> None:
        check_float("decision.margin_throughput", self.margin_throughput, 0.0, 1.0, lo_open=True)
        check_float("decision.margin_mix_efficiency", self.margin_mix_efficiency, 0.0, lo_open=True)
        check_float("decision.margin_heldout_tau", self.margin_heldout_tau, 0.0, lo_open=True)
        check_float("decision.margin_heldout_loss", self.margin_heldout_loss, 0.0, lo_open=True)
        check_float("decision.level", self.level, 0.0, lo_open=True)
        if self.level >= 1.0:
            raise ConfigError("decision.level", "must be a number > 0.0 and < 1.0", self.level)
        check_float("decision.z_refute", self.z_refute, 0.0, lo_open=True)


NOISE_MODELS = ("deterministic", "exponential", "lognormal", "empirical")


@dataclass(frozen=True)
class TimingConfig:
    """The simulator's compute-time model (replaced by ``--calibration``).

    Target forward time per item: ``target_fixed_s + target_per_token_s * n_seqs * padded_len
    + target_per_token2_s * n_seqs * padded_len**2`` (a padded micro-batch: linear layers plus
    attention). Drafter step time per take: ``drafter_fixed_s + drafter_per_token_s * tokens
    + drafter_per_anchor_s * anchors`` with anchors = min(drafter.anchors, response tokens) per
    sequence. Each is multiplied by a noise factor of mean 1.

    Defaults: an H200 node with an 8B-class target and a ~1B DFlash drafter, from docs/REFERENCE.md's
    SpecForge figures. Target: ~27K prefill tokens/s per capture GPU -> 37 us/token, 5 ms fixed.
    Drafter: the reported 53 ms fixed cost, with the per-anchor cost derived from the measured
    ~7 samples/s per trainer GPU at 512 anchors per sample (0.27 ms/anchor). The reported 0.73
    ms/anchor would give ~2.3 samples/s; we trust the measured throughput instead.
    """

    target_fixed_s: float = 0.005
    target_per_token_s: float = 3.7e-5
    target_per_token2_s: float = 0.0
    target_noise: str = "lognormal"
    target_cv: float = 0.10
    target_samples: tuple[float, ...] = ()
    drafter_fixed_s: float = 0.053
    drafter_per_token_s: float = 0.0
    drafter_per_anchor_s: float = 2.7e-4
    drafter_noise: str = "lognormal"
    drafter_cv: float = 0.05
    drafter_samples: tuple[float, ...] = ()
    response_fraction: float = 0.5  # share of a sequence's tokens that are response (anchor) tokens
    burst_amplitude: float = 0.0  # supply burstiness: target time x (1 + A sin(2 pi t / period))
    burst_period_s: float = 20.0
    hidden_size: int = 4096  # of the target: queue bytes per token = layers x hidden x dtype bytes
    dtype_bytes: int = 2
    # Moving an item's hidden states producer -> drafter, seconds per byte, by placement tier: one
    # device, two devices of one node, two nodes (dflash.core.links). None (the default): the named
    # [cluster] link's rate; 0 = free, only when set so. ``dflash calibrate`` sets the tiers its runs had.
    transfer_device_s_per_byte: float | None = None
    transfer_intra_s_per_byte: float | None = None
    transfer_inter_s_per_byte: float | None = None
    # Synchronised drafters: the DDP all-reduce of the drafter's gradient (memory.drafter_params x
    # memory.weight_bytes) costs 2 (n - 1) / n x bytes x this per step (ring all-reduce; 0 = free).
    allreduce_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        for role in ("target", "drafter"):
            for part in ("fixed_s", "per_token_s", "per_token2_s", "per_anchor_s"):
                key = f"{role}_{part}"
                if hasattr(self, key):
                    check_float(f"timing.{key}", getattr(self, key), 0.0)
            noise = check_choice(f"timing.{role}_noise", getattr(self, f"{role}_noise"), NOISE_MODELS)
            check_float(f"timing.{role}_cv", getattr(self, f"{role}_cv"), 0.0)
            samples = getattr(self, f"{role}_samples")
            if not isinstance(samples, (list, tuple)) or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in samples):
                raise ConfigError(f"timing.{role}_samples", "must be a list of positive numbers", samples)
            object.__setattr__(self, f"{role}_samples", tuple(float(x) for x in samples))
            if noise == "empirical" and not samples:
                raise ConfigError(f"timing.{role}_samples",
                                  f"must be non-empty when timing.{role}_noise = 'empirical'", samples)
        if self.target_fixed_s + self.target_per_token_s + self.target_per_token2_s <= 0:
            raise ConfigError("timing.target_fixed_s", "target time terms must not all be zero",
                              self.target_fixed_s)
        if self.drafter_fixed_s + self.drafter_per_token_s + self.drafter_per_anchor_s <= 0:
            raise ConfigError("timing.drafter_fixed_s", "drafter time terms must not all be zero",
                              self.drafter_fixed_s)
        check_float("timing.response_fraction", self.response_fraction, 0.0, 1.0, lo_open=True)
        check_float("timing.burst_amplitude", self.burst_amplitude, 0.0, 0.95)
        check_float("timing.burst_period_s", self.burst_period_s, 0.0, lo_open=True)
        check_int("timing.hidden_size", self.hidden_size, 1)
        check_int("timing.dtype_bytes", self.dtype_bytes, 1)
        for key in TIER_KEYS.values():
            if getattr(self, key) is not None:
                check_float(f"timing.{key}", getattr(self, key), 0.0)
        check_float("timing.allreduce_s_per_byte", self.allreduce_s_per_byte, 0.0)


@dataclass(frozen=True)
class MemoryConfig:
    """Sizes the per-device memory model (:mod:`dflash.core.memory_model`) needs beyond the queue.

    Hidden states are always counted (their size follows from the workload, target and timing
    sections). The rest is counted only when its size is given here, so nothing is guessed: target
    weights (``target_params``), the drafter's weights, gradients and optimizer state
    (``drafter_params``: trainable parameters of the draft layers and fusion projection), the frozen
    embedding/head and the loss's logits chunk (``vocab_size``), and the draft layers' saved
    activations (``intermediate_size``: the target's MLP width, which the draft layers copy).

    ``logits_bytes`` is what one row x vocabulary value of the loss's chunk costs at its peak: the
    head's output in the weight dtype, its float32 copy (overwritten in place by the softmax and its
    gradient) and ``logsumexp``'s float32 temporary beside them (2 + 4 + 4 = 10 for a bf16 head, issue
    33; 4 + 4 = 8 for a float32 one, where the copy is the output itself). ``activation_bytes`` is the bytes per saved
    activation value: 4 in float32 (the CPU; measured there, benchmarks/loss_memory.py
    --model-check); under CUDA's bf16 autocast the residual stream and the norms stay float32 and
    each projection input gets a bf16 copy, about 4 on average as well (not measured on a GPU).
    ``attention_width`` (heads x head_dim) defaults to the hidden size, ``kv_width`` (key/value
    heads x head_dim) to ``attention_width`` (no grouped-query attention: the larger count).
    """

    target_params: float | None = None
    drafter_params: float | None = None
    vocab_size: int | None = None
    intermediate_size: int | None = None
    attention_width: int | None = None
    kv_width: int | None = None
    weight_bytes: int = 2
    optimizer_bytes_per_param: int = 12  # AdamW: float32 master copy, m and v
    logits_bytes: int = 10
    activation_bytes: int = 4

    def __post_init__(self) -> None:
        for key in ("target_params", "drafter_params"):
            if getattr(self, key) is not None:
                check_float(f"memory.{key}", getattr(self, key), 0.0, lo_open=True)
        for key in ("vocab_size", "intermediate_size", "attention_width", "kv_width"):
            if getattr(self, key) is not None:
                check_int(f"memory.{key}", getattr(self, key), 1)
        check_int("memory.weight_bytes", self.weight_bytes, 1)
        check_int("memory.optimizer_bytes_per_param", self.optimizer_bytes_per_param, 0)
        check_int("memory.logits_bytes", self.logits_bytes, 1)
        check_int("memory.activation_bytes", self.activation_bytes, 1)


@dataclass(frozen=True)
class LossModelConfig:
    """How the step loss depends on the bucket make-up of a step (fitted by ``dflash calibrate``).

    The simulator has no model to train, yet the loss's roughness is decided by the order in which
    buckets reach the drafter. So a calibration fits, from a real run,
    ``log loss_s = trend(step) + sum_b f_sb * bucket_log_mean[b] + e_s``, with ``f_sb`` the share of
    the step's tokens from bucket ``b``, ``trend`` a polynomial in ``log(step + 1)`` (``trend_coef``,
    highest power first; flat after ``trend_last_step``), and ``e_s`` AR(1) noise of lag-1
    correlation ``autocorr`` whose spread is ``bucket_log_sd[b]``. A calibrated simulation replays
    its own take order through this model ``draws`` times and reports the mean ``loss_roughness``.
    Empty tables (the default): no prediction.
    """

    bucket_log_mean: tuple[float, ...] = ()
    bucket_log_sd: tuple[float, ...] = ()
    trend_coef: tuple[float, ...] = ()
    trend_last_step: int = 0
    autocorr: float = 0.0
    draws: int = 16

    def __post_init__(self) -> None:
        for key in ("bucket_log_mean", "bucket_log_sd", "trend_coef"):
            v = getattr(self, key)
            if not isinstance(v, (list, tuple)) or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v):
                raise ConfigError(f"loss_model.{key}", "must be a list of finite numbers", v)
            object.__setattr__(self, key, tuple(float(x) for x in v))
        if len(self.bucket_log_sd) != len(self.bucket_log_mean):
            raise ConfigError("loss_model.bucket_log_sd", "must have one value per bucket, like bucket_log_mean",
                              self.bucket_log_sd)
        if any(x < 0 for x in self.bucket_log_sd):
            raise ConfigError("loss_model.bucket_log_sd", "must be >= 0", self.bucket_log_sd)
        if self.bucket_log_mean and not self.trend_coef:
            raise ConfigError("loss_model.trend_coef", "must be non-empty when bucket_log_mean is given",
                              self.trend_coef)
        check_int("loss_model.trend_last_step", self.trend_last_step, 0)
        check_float("loss_model.autocorr", self.autocorr, -0.99, 0.99)
        check_int("loss_model.draws", self.draws, 1)

    @property
    def fitted(self) -> bool:
        return bool(self.bucket_log_mean)


def _check_devices(key: str, devices: object) -> None:
    if isinstance(devices, str):
        raise ConfigError(key, "must be a list such as [\"cpu\"] or [\"cuda:0\", \"cuda:1\"]", devices)
    if not isinstance(devices, (list, tuple)) or not devices:
        raise ConfigError(key, "must be a non-empty list of devices", devices)
    for d in devices:
        if not isinstance(d, str) or not (d == "cpu" or d == "cuda" or
                                          (d.startswith("cuda:") and d[5:].isdigit())):
            raise ConfigError(key, "each device must be 'cpu', 'cuda' or 'cuda:N'", d)


SECTIONS: dict[str, type] = {
    "workload": WorkloadConfig,
    "cluster": ClusterConfig,
    "queue": QueueConfig,
    "target": TargetConfig,
    "drafter": DrafterConfig,
    "train": TrainConfig,
    "metrics": MetricsConfig,
    "sweep": SweepConfig,
    "timing": TimingConfig,
    "loss_model": LossModelConfig,
    "memory": MemoryConfig,
    "decision": DecisionConfig,
}


@dataclass(frozen=True)
class DflashConfig:
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    timing: TimingConfig = field(default_factory=TimingConfig)
    loss_model: LossModelConfig = field(default_factory=LossModelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    decision: DecisionConfig = field(default_factory=DecisionConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("seed", self.seed, 0)
        if "n_target" in self.sweep.space and self.cluster.gpus is None:
            raise ConfigError("sweep.space.n_target", "needs [cluster] gpus = G, the GPU budget the split shares",
                              show_got=False)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {type(v).__name__}")


def config_to_toml(cfg: DflashConfig) -> str:
    """The config as a TOML file :func:`load_config` reads back to an equal config.

    Unset optional keys (None) are left out, since TOML has no null and absence means the default;
    nested tables (``[sweep.space]``) become sub-tables.
    """
    data = cfg.to_dict()
    lines = [f"seed = {data.pop('seed')}"]
    for section, table in data.items():
        lines.append(f"\n[{section}]")
        subtables = []
        for key, value in table.items():
            if value is None:
                continue
            if isinstance(value, dict):
                subtables.append((key, value))
                continue
            lines.append(f"{key} = {_toml_value(value)}")
        for key, sub in subtables:
            lines.append(f"\n[{section}.{key}]")
            for k, v in sub.items():
                if isinstance(v, dict):
                    lines.append(f"{json.dumps(k)} = {{ " + ", ".join(
                        f"{json.dumps(a)} = {_toml_value(b)}" for a, b in v.items() if b is not None) + " }")
                elif v is not None:
                    lines.append(f"{json.dumps(k)} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- loading
def _build_section(name: str, table: object) -> Any:
    cls = SECTIONS[name]
    if not isinstance(table, dict):
        raise ConfigError(f"[{name}]", "must be a table", table)
    known = {f.name for f in fields(cls)}
    for key in table:
        if key not in known:
            raise ConfigError(f"{name}.{key}", f"unknown key; allowed: {', '.join(sorted(known))}",
                              show_got=False)
    values = {k: (tuple(v) if isinstance(v, list) and k not in ("space", "grid_pairs") else v)
              for k, v in table.items()}
    return cls(**values)


def config_from_dict(data: dict[str, Any]) -> DflashConfig:
    """Build and validate a config from a TOML-shaped dict (sections plus an optional seed)."""
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key == "seed":
            kwargs["seed"] = value
        elif key in SECTIONS:
            kwargs[key] = _build_section(key, value)
        else:
            raise ConfigError(f"[{key}]", f"unknown section; allowed: {', '.join(SECTIONS)}, seed",
                              show_got=False)
    return DflashConfig(**kwargs)


def load_config(path: str | Path | None) -> DflashConfig:
    """Read a TOML file (or the built-in defaults for None); every failure is a ConfigError."""
    if path is None:
        return DflashConfig()
    p = Path(path)
    if not p.is_file():
        raise ConfigError("--config", "must be an existing TOML file", str(path))
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError("--config", f"malformed TOML in {p}: {exc}", show_got=False) from None
    return config_from_dict(data)


class _Unset:
    """The type of :data:`UNSET` (one instance; it pickles as itself, so a spawned rank keeps it)."""

    _one: _Unset | None = None

    def __new__(cls) -> _Unset:
        if cls._one is None:
            cls._one = super().__new__(cls)
        return cls._one

    def __repr__(self) -> str:
        return "UNSET"

    def __reduce__(self) -> str:
        return "UNSET"


UNSET = _Unset()  # an override that unsets an optional key (back to None: no limit, off)


def with_overrides(cfg: DflashConfig, overrides: dict[str, Any]) -> DflashConfig:
    """Apply ``{"queue.min_ready": 10, "seed": 3}``-style overrides and re-validate everything.

    Two values say something other than "this value": ``None`` is *no override* (the key keeps what
    ``cfg`` has; the command line's flag-not-given), and :data:`UNSET` unsets an optional key
    (``{"train.max_minutes": UNSET}``: no time limit), a ConfigError for a key that has no unset value.
    Why a marker: with ``None`` alone an override could not turn a limit off, and a caller that meant
    to was silently ignored.
    """
    sections: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for dotted, value in overrides.items():
        if value is None:
            continue
        if value is UNSET:
            value = _unset_value(dotted)
        if "." in dotted:
            sec, key = dotted.split(".", 1)
            sections.setdefault(sec, {})[key] = value
        else:
            top[dotted] = value
    new_sections = {}
    for sec, vals in sections.items():
        current = dataclasses.asdict(getattr(cfg, sec))
        current.update(vals)
        new_sections[sec] = _build_section(sec, current)
    return dataclasses.replace(cfg, **new_sections, **top)


def _unset_value(dotted: str) -> None:
    """None, for a key whose default is None (optional); else a ConfigError naming the key."""
    sec, _, key = dotted.rpartition(".")
    cls = SECTIONS.get(sec) if sec else DflashConfig
    field_ = next((f for f in fields(cls) if f.name == key), None) if cls is not None else None
    if field_ is None:
        raise ConfigError(dotted, "unknown key", show_got=False)
    if field_.default is not None:
        raise ConfigError(dotted, "cannot be unset: it has no unset value (give a value instead)", show_got=False)
