"""The serving layouts a trained drafter is exported to: one class per format, one interface.

Both layouts hold the same draft body under upstream's names (``layers.*``, ``fc.weight``,
``hidden_norm.weight``, ``norm.weight``: the very keys of :meth:`DFlashDrafter.state_dict`) and a
``config.json``; they differ in the config's shape, in the layer-id convention and in whether the
target's tables travel with the drafter:

* ``zlab`` (:class:`ZlabFormat`): the published ``z-lab/*-DFlash*`` checkpoints, which SGLang's
  ``--speculative-algorithm DFLASH`` and vLLM's DFlash proposer load. ``config.json`` is the draft
  layers' Qwen3 config plus ``architectures: ["DFlashDraftModel"]``, ``block_size``,
  ``num_target_layers`` and ``dflash_config: {mask_token_id, mask_token, target_layer_ids}``.
  Layer id ``i`` is read as ``hidden_states[i + 1]`` (z-lab's ``extract_context_feature``), which is
  exactly our capture convention, so the ids are written unchanged. No target weights.
* ``speculators`` (:class:`SpeculatorsFormat`): vLLM's speculators library (``DFlashSpeculatorConfig``
  / ``DFlashDraftModel``). Its ``aux_hidden_state_layer_ids`` index ``hidden_states`` directly, so
  each id is ours ``+ 1`` (as its ``DFlashConverter`` maps z-lab ids); the embedding and LM head
  are filled from the target, as the converter does.

A format only maps between a :class:`~dflash.model.drafter.DrafterSpec` (plus the target's tables)
and its files: :meth:`config` and :meth:`extra_tensors` write, :meth:`parse` reads back, and a
:class:`FormatError` names the key that is wrong. Writing files, the manifest and the checks live
in :mod:`dflash.model.export`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from dflash.model.drafter import DrafterSpec

CONFIG_JSON = "config.json"
WEIGHTS = "model.safetensors"
SPECULATORS_VERSION = "0.9.0"  # the release whose layout SpeculatorsFormat writes


class FormatError(ValueError):
    """An export whose files do not describe a valid drafter; ``what`` names the key or tensor."""

    def __init__(self, what: str, detail: str) -> None:
        self.what = what
        self.detail = detail
        super().__init__(f"{what}: {detail}")


@dataclass(frozen=True)
class TargetInfo:
    """What an export records of the target: its identity and the config keys serving needs."""

    model: str  # as the run named it ("smollm2", a path, a hub id)
    source: str  # what was loaded (resolved path or hub id): a transformers-loadable location
    num_layers: int
    architectures: tuple[str, ...]
    max_position_embeddings: int
    mask_token: str | None  # the MASK token's text, for the serving side to add or look up

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "source": self.source, "num_layers": self.num_layers,
                "architectures": list(self.architectures),
                "max_position_embeddings": self.max_position_embeddings, "mask_token": self.mask_token}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TargetInfo:
        return cls(model=str(d["model"]), source=str(d["source"]), num_layers=int(d["num_layers"]),
                   architectures=tuple(d.get("architectures", ())),
                   max_position_embeddings=int(d["max_position_embeddings"]), mask_token=d.get("mask_token"))


def qwen3_layer_config(spec: DrafterSpec, target: TargetInfo, dtype: torch.dtype) -> dict[str, Any]:
    """The draft layers' Qwen3 config (what upstream's ``DFlashDraftModel`` reads as its config).

    Default RoPE only (the drafter is trained with it whatever the target uses); ``rope_theta`` /
    ``rope_scaling`` for transformers 4.x readers and ``rope_parameters`` for 5.x.
    """
    return {
        "model_type": "qwen3", "hidden_size": spec.hidden_size, "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "intermediate_size": spec.intermediate_size, "hidden_act": "silu",
        "rms_norm_eps": spec.rms_norm_eps, "rope_theta": spec.rope_theta, "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "vocab_size": spec.vocab_size, "max_position_embeddings": target.max_position_embeddings,
        "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
        "layer_types": ["full_attention"] * spec.layers, "tie_word_embeddings": False,
        "initializer_range": 0.02, "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _int(cfg: dict[str, Any], key: str, where: str = "") -> int:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise FormatError(where + key, f"must be an integer >= 1, got {v!r}")
    return v


def _float(cfg: dict[str, Any], key: str, where: str = "") -> float:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
        raise FormatError(where + key, f"must be a number > 0, got {v!r}")
    return float(v)


def _ids(value: Any, key: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(i, int) and not isinstance(i, bool)
                                                            for i in value):
        raise FormatError(key, f"must be a non-empty list of layer ids, got {value!r}")
    return tuple(value)


def spec_from_qwen3(layer: dict[str, Any], *, target_layer_ids: tuple[int, ...], mask_token_id: Any,
                    block_size: Any, where: str = "") -> DrafterSpec:
    """A drafter spec from a Qwen3 layer config (either format's), checked key by key."""
    if layer.get("attention_bias"):
        raise FormatError(where + "attention_bias", "must be false (DFlash draft layers have no attention bias)")
    rope = layer.get("rope_scaling") or {}
    params = layer.get("rope_parameters") or {}
    if rope or params.get("rope_type", "default") != "default":
        raise FormatError(where + "rope_parameters", "only default RoPE is supported (the drafter trains with it)")
    theta = params.get("rope_theta", layer.get("rope_theta"))
    if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int):
        raise FormatError("mask_token_id", f"must be an integer token id, got {mask_token_id!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise FormatError("block_size", f"must be an integer >= 2, got {block_size!r}")
    heads = _int(layer, "num_attention_heads", where)
    try:
        return DrafterSpec(
            hidden_size=_int(layer, "hidden_size", where), num_heads=heads,
            num_kv_heads=_int(layer, "num_key_value_heads", where), head_dim=_int(layer, "head_dim", where),
            intermediate_size=_int(layer, "intermediate_size", where), vocab_size=_int(layer, "vocab_size", where),
            target_layer_ids=target_layer_ids, mask_token_id=mask_token_id,
            layers=_int(layer, "num_hidden_layers", where), block_size=block_size,
            rms_norm_eps=_float(layer, "rms_norm_eps", where),
            rope_theta=_float({"rope_theta": theta}, "rope_theta", where))
    except ValueError as exc:
        if isinstance(exc, FormatError):
            raise
        raise FormatError(where.rstrip(".") or "config", str(exc)) from None


class ExportFormat(Protocol):
    """One serving layout. ``parse(write(...))`` must give back the spec (the shared test suite)."""

    name: ClassVar[str]
    serves_with: ClassVar[str]  # what loads it, for messages and the report

    def config(self, spec: DrafterSpec, target: TargetInfo, dtype: torch.dtype) -> dict[str, Any]:
        """The ``config.json`` of this layout."""

    def extra_tensors(self, embed: torch.Tensor, head: torch.Tensor) -> dict[str, torch.Tensor]:
        """Target tensors this layout carries besides the draft body (``{}``: none)."""

    def extra_shapes(self, spec: DrafterSpec) -> dict[str, tuple[int, ...]]:
        """Names and shapes of :meth:`extra_tensors` implied by a spec."""

    def parse(self, config: dict[str, Any]) -> DrafterSpec:
        """The spec a ``config.json`` describes, capture ids in our convention; FormatError if not."""


class ZlabFormat:
    name: ClassVar[str] = "zlab"
    serves_with: ClassVar[str] = "SGLang (--speculative-algorithm DFLASH), vLLM (method dflash), z-lab dflash"

    def config(self, spec: DrafterSpec, target: TargetInfo, dtype: torch.dtype) -> dict[str, Any]:
        cfg = qwen3_layer_config(spec, target, dtype)
        cfg.update({
            "architectures": ["DFlashDraftModel"], "block_size": spec.block_size,
            "num_target_layers": target.num_layers,
            # upstream reads hidden_states[id + 1] for id in target_layer_ids: our capture ids as they are
            "dflash_config": {"mask_token_id": spec.mask_token_id, "mask_token": target.mask_token,
                              "target_layer_ids": list(spec.target_layer_ids)},
        })
        return cfg

    def extra_tensors(self, embed: torch.Tensor, head: torch.Tensor) -> dict[str, torch.Tensor]:
        return {}

    def extra_shapes(self, spec: DrafterSpec) -> dict[str, tuple[int, ...]]:
        return {}

    def parse(self, config: dict[str, Any]) -> DrafterSpec:
        if config.get("architectures") != ["DFlashDraftModel"]:
            raise FormatError("architectures", f"must be [\"DFlashDraftModel\"], got {config.get('architectures')!r}")
        dflash = config.get("dflash_config")
        if not isinstance(dflash, dict):
            raise FormatError("dflash_config", "missing (it holds mask_token_id and target_layer_ids)")
        ids = _ids(dflash.get("target_layer_ids"), "target_layer_ids")
        block = config.get("block_size", dflash.get("block_size"))
        return spec_from_qwen3(config, target_layer_ids=ids, mask_token_id=dflash.get("mask_token_id"),
                               block_size=block)


class SpeculatorsFormat:
    name: ClassVar[str] = "speculators"
    serves_with: ClassVar[str] = "vLLM (vllm serve DIR), speculators"

    def config(self, spec: DrafterSpec, target: TargetInfo, dtype: torch.dtype) -> dict[str, Any]:
        layer = qwen3_layer_config(spec, target, dtype)
        layer["dtype"] = layer["torch_dtype"]  # transformers 5 writes "dtype", 4.x "torch_dtype"
        # The keys and values speculators' DFlashConverter writes (checked against its output in tests).
        return {
            "architectures": ["DFlashDraftModel"], "speculators_model_type": "dflash",
            "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": layer,
            "draft_vocab_size": spec.vocab_size, "block_size": spec.block_size, "target_hidden_size": None,
            # speculators indexes hidden_states directly: hidden_states[id + 1] is its id + 1
            "aux_hidden_state_layer_ids": [i + 1 for i in spec.target_layer_ids],
            "mask_token_id": spec.mask_token_id, "sliding_window_non_causal": False, "sample_from_anchor": False,
            "speculators_config": {
                "algorithm": "dflash", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": spec.block_size - 1,
                                      "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                "verifier": {"name_or_path": target.source, "architectures": list(target.architectures)},
            },
            "tie_word_embeddings": False, "dtype": layer["dtype"], "torch_dtype": layer["dtype"],
        }

    def extra_tensors(self, embed: torch.Tensor, head: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"embed_tokens.weight": embed, "lm_head.weight": head}

    def extra_shapes(self, spec: DrafterSpec) -> dict[str, tuple[int, ...]]:
        vd = (spec.vocab_size, spec.hidden_size)
        return {"embed_tokens.weight": vd, "lm_head.weight": vd}

    def parse(self, config: dict[str, Any]) -> DrafterSpec:
        if config.get("speculators_model_type") != "dflash":
            raise FormatError("speculators_model_type", f"must be \"dflash\", got "
                                                        f"{config.get('speculators_model_type')!r}")
        layer = config.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise FormatError("transformer_layer_config", "missing (the draft layers' Qwen3 config)")
        aux = _ids(config.get("aux_hidden_state_layer_ids"), "aux_hidden_state_layer_ids")
        if config.get("draft_vocab_size") != layer.get("vocab_size"):
            raise FormatError("draft_vocab_size", "must equal the layer config's vocab_size (no draft vocabulary)")
        return spec_from_qwen3(layer, target_layer_ids=tuple(i - 1 for i in aux),
                               mask_token_id=config.get("mask_token_id"), block_size=config.get("block_size"),
                               where="transformer_layer_config.")


FORMATS: dict[str, ExportFormat] = {f.name: f for f in (ZlabFormat(), SpeculatorsFormat())}

__all__ = ["CONFIG_JSON", "FORMATS", "WEIGHTS", "ExportFormat", "FormatError", "SpeculatorsFormat", "TargetInfo",
           "ZlabFormat", "qwen3_layer_config", "spec_from_qwen3"]
