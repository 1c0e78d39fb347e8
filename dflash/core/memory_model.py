"""What one device holds, per role: the per-device memory model behind the sweep's memory
constraint and the trainer's pre-flight check.

Out-of-memory is the failure public drafter trainers report most, and the queue knobs decide a good
part of it: every queued item's hidden states stay on the producer that computed them until a
drafter takes them (docs/ARCHITECTURE.md, distributed pipeline). So a device's bytes are

- **target device** (one of a target worker's ``gpus_per_target`` GPUs): the target's weights
  (sharded evenly) and the hidden states its worker holds: its share of the queue plus the item it
  computed and holds at the cap. Hidden states are counted on one GPU of the worker (the capture
  output is not sharded), so that is the fullest GPU.
- **drafter device**: the drafter's weights, gradients and optimizer state, a frozen copy of the
  target's embedding and LM head, the hidden states of one take, and what one micro-batch (one
  item: the trainer runs forward and backward item by item) allocates for its backward:
  - the **logits chunk** of the loss: at most ``drafter.loss_chunk_rows`` rows x vocabulary x
    ``memory.logits_bytes`` (the loss never holds more: :mod:`dflash.model.chunked_ce`);
  - the **draft layers' saved activations** for anchors x block query positions and the
    ``[context ; blocks]`` key/value positions, plus the attention mask (:func:`activation_bytes`).

Beyond these (issue 33): the **pooled buffers** of the data plane, one per item in flight
(:func:`pool_buffers`: the producer's send pool on a sharing plane, the drafter's receive pool on a
copying one), the target's **capture forward** (:func:`target_forward_bytes`), and on a GPU the **CUDA
context** and the caching allocator's **slack** (:data:`CUDA_CONTEXT_BYTES`, :data:`ALLOCATOR_SLACK`: not
measured yet, see docs/ARCHITECTURE.md). A **CPU rank** also counts what its loop pages in (the weights
its forward reads from the memory-mapped checkpoint, :func:`target_paged_bytes`; the drafter's frozen
tables; torch's kernel code, :data:`KERNEL_CODE_BYTES`) and its process (:data:`PROCESS_BYTES`: the
host RAM of a rank, which on the CPU is its device); a GPU rank's host RAM is :func:`host_memory`.
Roles that share one device are summed there (:func:`per_device`, the GPU ranks' host RAM on the device
:data:`HOST`), and :func:`check_fits` holds each device against its capacity (the device's own, given by
the caller). The CPU-measurable part of a rank is what its training loop adds (:func:`loop_bytes`):
everything but the parts already there before the first step (:data:`AT_START`); benchmarks/rank_memory.py
holds it within 10% of three shapes' ranks.

A static check (no simulation) assumes the queue's items spread evenly over producers and that an
item is as large as the workload allows (``max_len`` per sequence); the simulator passes the peaks
it saw instead. Sizes not given in ``[memory]`` are not counted and the result says so. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dflash.core.config import DflashConfig
from dflash.core.errors import ConfigError

GIB = 2**30
MIB = 2**20
TARGET, DRAFTER = "target", "drafter"
HOST = "host"  # the node's host RAM, where GPU ranks keep their processes (a CPU rank's device is "cpu")
POOL_BUFFERS = 4  # dflash.pipeline.transport.POOL_BUFFERS (this layer is torch-free; a test ties the two)
CUDA_CONTEXT_BYTES = 0.5 * GIB  # per process on a GPU: CUDA context, cuBLAS/NCCL workspaces (unverified)
ALLOCATOR_SLACK = 0.10  # the caching allocator's fragmentation, of what a GPU rank allocates (unverified)
# Host RAM of a rank process before its first step: Python, torch, transformers, the tokenizer, gloo, the data
# set's index (measured on the CPU: 399-413 MiB VmRSS per rank, benchmarks/rank_memory.py; on a GPU node the
# CUDA libraries add to it: unverified)
PROCESS_BYTES = 400 * MIB
# torch's kernel code a CPU rank's first step pages in (resident pages of torch/lib/*.so, /proc/self/smaps,
# dflash/pipeline/hostmem.py): the same kernels whatever the shape, measured 10.0-11.0 MiB on a drafter rank
# (forward, backward, AdamW), 3.6-4.5 MiB on a target rank (a forward), torch 2.13 CPU
KERNEL_CODE_BYTES = {TARGET: 4 * MIB, DRAFTER: 11 * MIB}
PAGED_WEIGHTS, PAGED_TABLES = "weights paged in", "frozen embedding and head paged in"  # on the CPU
AT_START = frozenset({"weights", "frozen embedding and head", "CUDA context", "process"})  # before the first step


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes one device of a role holds at its peak, by part."""

    role: str
    parts: tuple[tuple[str, float], ...]
    not_counted: tuple[str, ...] = ()

    @property
    def total(self) -> float:
        return float(sum(b for _, b in self.parts))

    def describe(self) -> str:
        parts = " + ".join(f"{name} {b / GIB:.1f}" for name, b in self.parts if b > 0) or "nothing counted"
        return f"a {self.role} device needs {self.total / GIB:.1f} GiB ({parts})"


def bytes_per_token(cfg: DflashConfig) -> int:
    """Hidden-state bytes of one token: captured layers x hidden size x dtype bytes."""
    return cfg.target.capture_layers * cfg.timing.hidden_size * cfg.timing.dtype_bytes


def max_item_bytes(cfg: DflashConfig) -> int:
    """The largest item the workload can form: every sequence padded to ``max_len``."""
    w = cfg.workload
    tokens = w.seqs_per_item * w.max_len if w.seqs_per_item is not None else w.tokens_per_item
    assert tokens is not None
    return tokens * bytes_per_token(cfg)


def item_shape(cfg: DflashConfig) -> tuple[int, int, int]:
    """The largest micro-batch the workload allows: ``(sequences, tokens per sequence, anchors per
    sequence)``. With ``seqs_per_item``, every sequence at ``max_len``; with ``tokens_per_item``,
    the fewest and longest sequences that fill it. A sequence has at most min(anchors, length - 1)
    anchors (a response token followed by another; a block may run past the end: docs/guide/anchor-rule.md)."""
    w, d = cfg.workload, cfg.drafter
    if w.seqs_per_item is not None:
        seqs, length = w.seqs_per_item, w.max_len
    else:
        assert w.tokens_per_item is not None
        seqs, length = math.ceil(w.tokens_per_item / w.max_len), min(w.max_len, w.tokens_per_item)
    return seqs, length, min(d.anchors, max(0, length - 1))


def logit_rows(cfg: DflashConfig) -> int:
    """Rows through the LM head in one micro-batch (one item): anchors x (block size - 1) slots."""
    seqs, _, anchors = item_shape(cfg)
    return seqs * anchors * (cfg.drafter.block_size - 1)


def logits_chunk_bytes(cfg: DflashConfig) -> float:
    """The loss's peak: one chunk of at most ``loss_chunk_rows`` rows x vocabulary x ``logits_bytes``."""
    m = cfg.memory
    assert m.vocab_size is not None
    return float(min(cfg.drafter.loss_chunk_rows, logit_rows(cfg)) * m.vocab_size * m.logits_bytes)


def activation_bytes(cfg: DflashConfig) -> float:
    """What one item's forward keeps for its backward in the draft layers (docs/ARCHITECTURE.md: the memory
    model counts what the implementation allocates; counted from ``dflash/model/drafter.py``).

    With ``Q`` query positions (sequences x anchors x B), ``N`` key/value positions (sequences x
    (S + anchors x B): the context and every block), hidden ``d``, attention width ``H``, key/value
    width ``KV`` and MLP width ``I``, each draft layer keeps, in values of ``activation_bytes``:

    - per query position ``6d + 7H + 4I``: the residual input, the two RMSNorms (their normalised
      input and output: 2 x 2d), the residual after attention; q, its q-norm (2), its RoPE rotation
      and result, the attention output and its reshaped copy for ``o_proj``; the MLP's gate, up,
      SiLU(gate) and their product;
    - per key/value position ``d + 6KV`` (+ ``2H`` when grouped-query attention repeats k and v):
      ``[context ; blocks]`` concatenated, k, its k-norm (2), RoPE rotation and result, v;
    - the attention mask as the attention's additive bias: sequences x (anchors B) x (S + anchors B).

    With ``drafter.checkpoint_layers`` a layer keeps only its input (``d`` per query position) and
    one layer's activations exist at a time, while the backward recomputes it.

    Once per item: the embedded blocks and the final norm (``4d`` per query position), the fused
    context (``3d`` per context position: ``fc``'s output and its RMSNorm's two), the boolean mask
    (1 byte per entry), the loss's counted rows and their gradient (``2d`` per row).
    """
    m = cfg.memory
    assert m.intermediate_size is not None
    seqs, length, anchors = item_shape(cfg)
    bs, layers, d = cfg.drafter.block_size, cfg.drafter.layers, cfg.timing.hidden_size
    h = m.attention_width or d
    kv = m.kv_width or h
    q = seqs * anchors * bs
    n = seqs * (length + anchors * bs)
    mask = seqs * anchors * bs * (length + anchors * bs)
    per_layer = q * (6 * d + 7 * h + 4 * m.intermediate_size) + n * (d + 6 * kv + (2 * h if kv < h else 0)) + mask
    once = q * 4 * d + seqs * length * 3 * d + logit_rows(cfg) * 2 * d
    # checkpoint_layers: each layer keeps only its input; one layer's activations exist at a time
    # (the one being recomputed in the backward)
    layers_part = layers * q * d + per_layer if cfg.drafter.checkpoint_layers else layers * per_layer
    return float((layers_part + once) * m.activation_bytes + mask)


def pool_buffers(cfg: DflashConfig, role: str) -> int:
    """Buffers a data-plane pool holds at its peak: one per item in flight at once, never more (a pool makes
    a buffer only when none is free, and keeps at most :data:`POOL_BUFFERS` free ones for reuse). A
    drafter trains one take at a time and releases its items before it asks for the next step, so at most
    one round is in flight: a drafter's receive pool holds ``items_per_take``, a producer's send pool at
    most every drafter's take (``n_drafter x items_per_take``: all of a round's items from this producer).
    Measured on the CPU: one shared buffer resident on each rank of a 1 + 1 job (``RssShmem``)."""
    per_take = cfg.queue.items_per_take
    return per_take if role == DRAFTER else cfg.cluster.n_drafter * per_take


def producer_hidden_bytes(cfg: DflashConfig, n_target: int | None = None) -> float:
    """A static estimate: an even share of the queue at its cap, plus the item held at the cap."""
    n = n_target or cfg.cluster.n_target
    item = max_item_bytes(cfg)
    queued = cfg.queue.max_depth * item
    if cfg.queue.max_bytes is not None:
        queued = min(queued, cfg.queue.max_bytes)
    return queued / n + item


def target_forward_bytes(cfg: DflashConfig) -> float:
    """The capture forward's peak (inference, to the deepest captured layer): the captured layers'
    outputs and their concatenation (``2 K d`` per token), one decoder layer's transient (``2d + H + 2KV
    + 3I`` per token: normed input, q, k, v, the MLP's gate, up and product) and the 4-D attention mask
    transformers builds (sequences x S x S), in the target's dtype (``memory.weight_bytes``). Needs
    ``memory.intermediate_size``; 0 without it (and :func:`target_device` says so)."""
    m = cfg.memory
    if m.intermediate_size is None:
        return 0.0
    seqs, length, _ = item_shape(cfg)
    d = cfg.timing.hidden_size
    h = m.attention_width or d
    kv = m.kv_width or h
    tokens = seqs * length
    per_token = 2 * cfg.target.capture_layers * d + 2 * d + h + 2 * kv + 3 * m.intermediate_size
    return float((tokens * per_token + seqs * length * length) * m.weight_bytes)


def target_layer_params(cfg: DflashConfig) -> int | None:
    """Parameters of one target decoder layer: q and o (``d x H`` each), k and v (``d x KV`` each), the
    MLP's gate, up and down (``d x I`` each), two RMSNorms (``d`` each). None without ``intermediate_size``."""
    m = cfg.memory
    if m.intermediate_size is None:
        return None
    d = cfg.timing.hidden_size
    h = m.attention_width or d
    kv = m.kv_width or h
    return 2 * d * h + 2 * d * kv + 3 * d * m.intermediate_size + 2 * d


def target_paged_bytes(cfg: DflashConfig) -> float | None:
    """What a CPU target rank's capture forward reads of its weights: one item's embedding rows and every
    layer up to the deepest captured one (``capture_layer_ids``: layer L - 3 for K >= 2, L // 2 for K = 1).

    Why it is the loop's: a float32 CPU load keeps the checkpoint's safetensors memory-mapped, so a weight
    becomes resident (file pages, counted in ``VmRSS``) only when a forward first reads it; the layers past
    the deepest captured one are never read (the forward stops there). Of the embedding, the rows of one
    item's tokens (at most the vocabulary). The layer count comes from ``target_params`` (less the
    embedding and an untied head). None where a size is missing."""
    m = cfg.memory
    per_layer = target_layer_params(cfg)
    if m.target_params is None or m.vocab_size is None or per_layer is None:
        return None
    d = cfg.timing.hidden_size
    tables = 2 * m.vocab_size * d + d  # embedding, head, final norm
    layers = max(1, round((m.target_params - tables) / per_layer))
    k = cfg.target.capture_layers
    depth = layers // 2 + 1 if k == 1 else max(1, layers - 2)
    seqs, length, _ = item_shape(cfg)
    return float((min(m.vocab_size, seqs * length) * d + min(depth, layers) * per_layer) * m.weight_bytes)


def _cpu_parts(role: str) -> list[tuple[str, float]]:
    """A CPU rank's kernel code (paged in by its first step) and its process (host RAM before the step)."""
    return [("kernel code", float(KERNEL_CODE_BYTES[role])), ("process", float(PROCESS_BYTES))]


def _gpu_parts(parts: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """A GPU rank's CUDA context and the allocator's slack on what it allocates (both unverified)."""
    allocated = sum(b for _, b in parts)
    return [("CUDA context", CUDA_CONTEXT_BYTES), ("allocator slack", ALLOCATOR_SLACK * allocated)]


def target_device(cfg: DflashConfig, hidden_bytes: float | None = None, n_target: int | None = None,
                  *, on_gpu: bool = True, sharing: bool = True) -> DeviceMemory:
    """A target rank's device. ``sharing``: the plane packs each sent item into the producer's pooled
    shareable buffer (shm, CUDA IPC); on a copying plane the send reads the item itself."""
    m = cfg.memory
    parts: list[tuple[str, float]] = []
    missing: list[str] = []
    if m.target_params is not None:
        weights = m.target_params * m.weight_bytes / cfg.cluster.gpus_per_target
        paged = None if on_gpu else target_paged_bytes(cfg)  # on the CPU the forward pages in what it reads
        parts.append(("weights", weights - (paged or 0.0)))
        if paged is not None:
            parts.append((PAGED_WEIGHTS, paged))
    else:
        missing.append("target weights (memory.target_params)")
    held = producer_hidden_bytes(cfg, n_target) if hidden_bytes is None else hidden_bytes
    parts.append(("hidden states", float(held)))
    if sharing:
        parts.append(("pooled buffers", float(pool_buffers(cfg, TARGET) * max_item_bytes(cfg))))
    if m.intermediate_size is not None:
        parts.append(("capture forward", target_forward_bytes(cfg)))
    else:
        missing.append("the capture forward (memory.intermediate_size)")
    parts += _gpu_parts(parts) if on_gpu else _cpu_parts(TARGET)
    return DeviceMemory(TARGET, tuple(parts), tuple(missing))


def drafter_device(cfg: DflashConfig, hidden_bytes: float | None = None, *, on_gpu: bool = True,
                   sharing: bool = True) -> DeviceMemory:
    """A drafter rank's device. On a copying plane the items arrive in its receive pool, which keeps up
    to :data:`POOL_BUFFERS` free buffers besides the take in use; on a sharing plane it maps the
    producer's buffers (counted there on a GPU; on the CPU shared pages count in both processes)."""
    m = cfg.memory
    parts: list[tuple[str, float]] = []
    missing: list[str] = []
    if m.drafter_params is not None:
        # the gradients exist only from the backward on (the optimizer sets them to None after each step), when
        # the loss's chunk is freed: the step's peak holds the chunk (forward) or the gradients (backward), and
        # the gradients add only what exceeds the chunk (measured on the CPU: no rise in the backward)
        chunk = logits_chunk_bytes(cfg) if m.vocab_size is not None else 0.0
        parts += [("weights", m.drafter_params * m.weight_bytes),
                  ("gradients", max(0.0, m.drafter_params * m.weight_bytes - chunk)),
                  ("optimizer", m.drafter_params * m.optimizer_bytes_per_param)]
    else:
        missing.append("drafter weights and optimizer (memory.drafter_params)")
    held = cfg.queue.items_per_take * max_item_bytes(cfg) if hidden_bytes is None else hidden_bytes
    parts.append(("hidden states", float(held)))
    if not sharing:
        parts.append(("pooled buffers", float(pool_buffers(cfg, DRAFTER) * max_item_bytes(cfg))))
    if m.vocab_size is not None:
        # on a GPU copied to the device at load (there before the first step); on the CPU memory-mapped from the
        # checkpoint and paged in by the first step (the head is read whole, the embedding nearly: fault-around)
        parts.append((PAGED_TABLES if not on_gpu else "frozen embedding and head",
                      2 * m.vocab_size * cfg.timing.hidden_size * m.weight_bytes))
        parts.append(("logits chunk", logits_chunk_bytes(cfg)))
    else:
        missing.append("frozen embedding/head and logits (memory.vocab_size)")
    if m.intermediate_size is not None:
        parts.append(("activations", activation_bytes(cfg)))
    else:
        missing.append("draft-layer activations (memory.intermediate_size)")
    parts += _gpu_parts(parts) if on_gpu else _cpu_parts(DRAFTER)
    return DeviceMemory(DRAFTER, tuple(parts), tuple(missing))


def host_memory(cfg: DflashConfig, role: str) -> DeviceMemory:
    """Host RAM of a GPU rank (a CPU rank's host RAM is its device, :data:`PROCESS_BYTES` among its parts):
    its process, and on a drafter rank the target's embedding and LM head it loaded on the host and keeps
    for the run (``dflash/pipeline/rank.py`` ``_load``: read from the checkpoint, converted to the run's
    dtype, copied to the device; the host copy stays referenced). A target rank loads straight onto its
    device. Unverified on a GPU (the CUDA libraries' own host memory is not in it)."""
    parts: list[tuple[str, float]] = [("process", float(PROCESS_BYTES))]
    m = cfg.memory
    if role == DRAFTER and m.vocab_size is not None:
        parts.append(("frozen embedding and head", float(2 * m.vocab_size * cfg.timing.hidden_size * m.weight_bytes)))
    return DeviceMemory(role, tuple(parts))


def loop_bytes(dev: DeviceMemory) -> float:
    """What a rank's training loop adds above what it holds before the first step (the CPU-measurable
    figure: the peak ``VmHWM`` over the steps minus ``VmHWM`` before the first, dflash/pipeline/hostmem.py)."""
    return float(sum(b for name, b in dev.parts if name not in AT_START))


def device_memory(cfg: DflashConfig, *, n_target: int | None = None, producer_bytes: float | None = None,
                  drafter_bytes: float | None = None, on_gpu: bool = True, sharing: bool = True
                  ) -> tuple[DeviceMemory, DeviceMemory]:
    """(target device, drafter device); hidden-state peaks from a simulation when given."""
    return (target_device(cfg, producer_bytes, n_target, on_gpu=on_gpu, sharing=sharing),
            drafter_device(cfg, drafter_bytes, on_gpu=on_gpu, sharing=sharing))


def fullest_device_bytes(cfg: DflashConfig, **peaks: float | None) -> float:
    return max(d.total for d in device_memory(cfg, **peaks))  # type: ignore[arg-type]


@dataclass(frozen=True)
class DeviceNeed:
    """What the ranks placed on one device need together, against what it holds."""

    device: str
    roles: tuple[DeviceMemory, ...]
    capacity: float | None

    @property
    def total(self) -> float:
        return float(sum(r.total for r in self.roles))

    def line(self) -> str:
        shares = "; ".join(f"{r.role} {r.total / GIB:.1f}: " + " + ".join(
            f"{name} {b / GIB:.1f}" for name, b in r.parts if b > 0) for r in self.roles)
        cap = "no capacity known" if self.capacity is None else f"holds {self.capacity / GIB:.1f} GiB"
        return f"{self.device} needs {self.total / GIB:.1f} GiB ({shares}) but {cap}"


def per_device(cfg: DflashConfig, placement: list[tuple[str, str]], capacity: dict[str, float] | None = None,
               *, sharing: bool = True) -> list[DeviceNeed]:
    """Sum, per device, the roles of the ranks placed there (``placement``: (role, device) per rank,
    e.g. a target and a drafter rank on one shared GPU, or every CPU rank on the host ``cpu``)."""
    by_dev: dict[str, list[DeviceMemory]] = {}
    for role, device in placement:
        on_gpu = device != "cpu"  # a planned device (no placement given) is a GPU
        dev = (target_device(cfg, on_gpu=on_gpu, sharing=sharing) if role == TARGET
               else drafter_device(cfg, on_gpu=on_gpu, sharing=sharing))
        by_dev.setdefault(device, []).append(dev)
        if device.startswith("cuda"):  # a GPU rank's host RAM: the node's host holds every rank's (HOST)
            by_dev.setdefault(HOST, []).append(host_memory(cfg, role))
    cap = capacity or {}
    return [DeviceNeed(d, tuple(roles), cap.get(d)) for d, roles in by_dev.items()]


def check_fits(cfg: DflashConfig, placement: list[tuple[str, str]] | None = None,
               capacity: dict[str, float] | None = None, *, force: bool = False) -> None:
    """Pre-flight: refuse, in one line naming the device, the need and the capacity, a run whose
    devices would not hold it (ConfigError). ``--force`` is the one way past it.

    ``capacity``: bytes per device from the device itself (CUDA's total memory; the host's available
    memory for CPU ranks). Where none is given (no device present: planning, a sweep) the configured
    ``sweep.memory_budget_gib`` per device is the capacity, and without it nothing is checked.
    """
    if force:
        return
    budget = cfg.sweep.memory_budget_gib
    if placement is None:  # planning: one target and one drafter device, each against the budget
        placement = [(TARGET, "the target device"), (DRAFTER, "the drafter device")]
    if not capacity:
        if budget is None:
            return
        capacity = {d: budget * GIB for _, d in placement}
        key = "sweep.memory_budget_gib"
    else:
        key = "memory"
    for need in per_device(cfg, placement, capacity):
        if need.capacity is not None and need.total > need.capacity:
            missing = sorted({x for r in need.roles for x in r.not_counted})
            tail = f"; not counted: {', '.join(missing)}" if missing else ""
            raise ConfigError(key, f"{need.line()} (--force starts it anyway){tail}", show_got=False)


def allreduce_seconds(cfg: DflashConfig, n_drafter: int) -> float:
    """One step's ring all-reduce of the drafter's gradient: 2 (n - 1) / n x bytes x s/byte (0 when
    the gradient size or the cost is not configured, or with one drafter)."""
    m, per_byte = cfg.memory, cfg.timing.allreduce_s_per_byte
    if m.drafter_params is None or per_byte == 0 or n_drafter < 2:
        return 0.0
    return 2 * (n_drafter - 1) / n_drafter * math.ceil(m.drafter_params) * m.weight_bytes * per_byte
