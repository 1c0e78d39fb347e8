"""Export a trained drafter to a serving layout, and check an export on load: never silently wrong.

:func:`export_drafter` writes one format of :data:`~dflash.model.export_formats.FORMATS` into a
temporary sibling of the output directory, then loads what it wrote and renames it into place only
if every check passes (a failed export leaves nothing under the output name):

1. **Our reader, exact.** The drafter rebuilt from the export's own ``config.json`` and
   ``model.safetensors`` around the same target gives the trained drafter's full-vocabulary logits
   on the reference input bit for bit in float32 (``torch.equal``).
2. **The export alone** (:func:`check_export`, also ``dflash export --check DIR``): the config
   parses; its capture ids, block size and MASK id are the ones the manifest says the drafter was
   trained with; every tensor the config implies is there with its shape and nothing else is; the
   stored reference output is reproduced from the files alone; every file's sha256 is the
   manifest's. The first failure is one line that names what is wrong (``target_layer_ids: ...``).
3. **An independent reader** (:mod:`dflash.model.export_independent`): vLLM's ``speculators``
   package, in a virtual environment of its own, loads the export (a z-lab export through its
   ``DFlashConverter``) and its forward matches the reference within float32 tolerance; skipped,
   with the reason, where that environment is not installed.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash.model.drafter import CONFIG_FILE, WEIGHTS_FILE, DFlashDrafter, DrafterSpec
from dflash.model.export_formats import CONFIG_JSON, FORMATS, WEIGHTS, ExportFormat, FormatError, TargetInfo
from dflash.model.export_reference import (
    MANIFEST,
    MANIFEST_VERSION,
    REFERENCE_FILE,
    ExportCheckError,
    Reference,
    compare,
    make_reference,
    row_logits,
    run_drafter,
    sha256_of,
    write_manifest,
)


@dataclass
class CheckReport:
    """What was checked: ``(name, status, detail)`` rows, status ``ok`` / ``skipped``."""

    rows: list[tuple[str, str, str]] = field(default_factory=list)

    def add(self, name: str, status: str, detail: str = "") -> None:
        self.rows.append((name, status, detail))

    def lines(self) -> list[str]:
        return [f"  {name}: {status}" + (f" ({detail})" if detail else "") for name, status, detail in self.rows]


# --------------------------------------------------------------------------- export
def saved_drafter(drafter_dir: Path) -> tuple[DrafterSpec, dict[str, torch.Tensor], torch.dtype]:
    """The spec, the tensors exactly as saved, and the dtype of a ``DFlashDrafter.save`` directory."""
    from safetensors.torch import load_file

    meta = json.loads((drafter_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    spec = DrafterSpec.from_json(meta["spec"])
    return spec, load_file(str(drafter_dir / WEIGHTS_FILE)), getattr(torch, meta.get("dtype", "float32"))


def target_info(model: nn.Module, tokenizer: Any, target_model: str, source: str, spec: DrafterSpec) -> TargetInfo:
    cfg = model.config
    mask = tokenizer.convert_ids_to_tokens(spec.mask_token_id) if tokenizer is not None else None
    return TargetInfo(model=target_model, source=source, num_layers=int(cfg.num_hidden_layers),
                      architectures=tuple(getattr(cfg, "architectures", None) or (type(model).__name__,)),
                      max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 2048)),
                      mask_token=mask)


def export_drafter(drafter_dir: str | Path, out: str | Path, fmt: str, *, model: nn.Module, tokenizer: Any,
                   target_model: str, target_source: str, run_dir: str | Path | None = None,
                   independent: bool = True) -> CheckReport:
    """Export the drafter saved in ``drafter_dir`` (trained around ``model``) to ``out`` as ``fmt``.

    ``target_model`` is the run's ``target.model``; ``target_source`` where transformers loads the
    target from (a checkpoint directory or a hub id: the speculators layout names it as its verifier,
    and the independent reader loads the target's tables from it). Raises :class:`ExportCheckError`
    (nothing is left at ``out``) if the export fails a check.
    """
    layout = FORMATS[fmt]
    src = Path(drafter_dir)
    spec, state, dtype = saved_drafter(src)
    trained = DFlashDrafter.load(src, model, dtype=torch.float32)
    info = target_info(model, tokenizer, target_model, target_source, spec)
    final = Path(out)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        ref = _write(tmp, layout, spec, state, dtype, trained, info, run_dir)
        report = CheckReport()
        _check_exact(tmp, layout, trained, ref, model, report)
        report.rows.extend(check_export(tmp, independent=independent).rows)
        _publishable(tmp)
        if final.exists():
            final.rmdir()  # validated empty at the edge
        os.replace(tmp, final)
        return report
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publishable(out: Path) -> None:
    """The permissions a plain mkdir/open would have given (mkdtemp and safetensors use 0700/0600), so
    a serving engine under another user can read the export."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out, 0o777 & ~umask)
    for f in out.iterdir():
        os.chmod(f, 0o666 & ~umask)


def _write(out: Path, layout: ExportFormat, spec: DrafterSpec, state: dict[str, torch.Tensor], dtype: torch.dtype,
           trained: DFlashDrafter, info: TargetInfo, run_dir: str | Path | None) -> Reference:
    from safetensors.torch import save_file

    embed = trained.embed_tokens.weight.detach().to("cpu", dtype)
    head = trained.lm_head.weight.detach().to("cpu", dtype)
    tensors = {k: v.contiguous() for k, v in state.items()}
    tensors.update({k: v.clone().contiguous() for k, v in layout.extra_tensors(embed, head).items()})
    (out / CONFIG_JSON).write_text(json.dumps(layout.config(spec, info, dtype), indent=2), encoding="utf-8")
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    ref = make_reference(trained)
    save_file(ref.tensors(), str(out / REFERENCE_FILE))
    write_manifest(out, {
        "format": layout.name, "target": info.to_json(), "capture_layers": list(spec.target_layer_ids),
        "layer_id_convention": "hidden_states[id + 1] of a transformers forward (index 0: embeddings)",
        "block_size": spec.block_size, "mask_token_id": spec.mask_token_id, "mask_token": info.mask_token,
        "dtype": str(dtype).removeprefix("torch."), "training": {"anchors": spec.anchors, "gamma": spec.gamma},
        "run_dir": str(Path(run_dir).resolve()) if run_dir is not None else None,
    }, [CONFIG_JSON, WEIGHTS, REFERENCE_FILE])
    return ref


def _check_exact(out: Path, layout: ExportFormat, trained: DFlashDrafter, ref: Reference, model: nn.Module,
                 report: CheckReport) -> None:
    """Our reader around the real target reproduces the trained drafter's full logits exactly."""
    spec = layout.parse(json.loads((out / CONFIG_JSON).read_text(encoding="utf-8")))
    back = DFlashDrafter.from_target(model, spec, device=trained.fc.weight.device, dtype=torch.float32)
    back.load_state_dict(_body(_load_tensors(out), layout, spec), strict=True)
    dev = trained.fc.weight.device
    ctx, anchors, token = ref.context.to(dev), ref.anchors.to(dev), ref.block_ids[:, :1].to(dev)
    with torch.no_grad():  # the whole drafter, token ids to full-vocabulary logits
        want = trained.logits(trained.block_hidden(ctx, token, anchors))
        got = back.logits(back.block_hidden(ctx, token, anchors))
    if not torch.equal(got, want):
        raise ExportCheckError("our reader", "the exported drafter's logits differ from the trained drafter's "
                                             f"(max |diff| {float((got - want).abs().max()):.3g})")
    report.add("our reader, full-vocabulary logits vs the trained drafter", "ok", "bit-identical in float32")


# --------------------------------------------------------------------------- check
def _load_tensors(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / WEIGHTS))


def _body(tensors: dict[str, torch.Tensor], layout: ExportFormat, spec: DrafterSpec) -> dict[str, torch.Tensor]:
    extra = layout.extra_shapes(spec)
    return {k: v for k, v in tensors.items() if k not in extra}


def _meta_tables(spec: DrafterSpec) -> tuple[nn.Module, nn.Module]:
    """Stand-ins for the target's tables with no storage: a drafter around them runs everything
    from embedded blocks to final hidden states (:meth:`DFlashDrafter.hidden_from_embeddings`)."""
    return (nn.Embedding(spec.vocab_size, spec.hidden_size, device="meta"),
            nn.Linear(spec.hidden_size, spec.vocab_size, bias=False, device="meta"))


def expected_shapes(layout: ExportFormat, spec: DrafterSpec) -> dict[str, tuple[int, ...]]:
    embed, head = _meta_tables(spec)
    with torch.device("meta"):
        body = DFlashDrafter(spec, embed, head)
    shapes = {k: tuple(v.shape) for k, v in body.state_dict().items()}
    shapes.update(layout.extra_shapes(spec))
    return shapes


def read_manifest(out: Path) -> dict[str, Any]:
    path = out / MANIFEST
    if not path.is_file():
        raise ExportCheckError(MANIFEST, "missing: not a dflash export (or written by something else)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportCheckError(MANIFEST, f"unreadable ({exc})") from None
    if manifest.get("manifest_version") != MANIFEST_VERSION or manifest.get("format") not in FORMATS:
        raise ExportCheckError(MANIFEST, f"version {manifest.get('manifest_version')!r} / format "
                                         f"{manifest.get('format')!r} is not one this dflash reads")
    return manifest


def _parse_config(out: Path, layout: ExportFormat) -> DrafterSpec:
    path = out / CONFIG_JSON
    if not path.is_file():
        raise ExportCheckError(CONFIG_JSON, "missing")
    try:
        return layout.parse(json.loads(path.read_text(encoding="utf-8")))
    except json.JSONDecodeError as exc:
        raise ExportCheckError(CONFIG_JSON, f"not JSON ({exc})") from None
    except FormatError as exc:
        raise ExportCheckError(exc.what, exc.detail) from None


def _check_against_manifest(spec: DrafterSpec, manifest: dict[str, Any], layout: ExportFormat) -> None:
    trained_ids = [int(i) for i in manifest["capture_layers"]]
    if list(spec.target_layer_ids) != trained_ids:
        key = "aux_hidden_state_layer_ids" if layout.name == "speculators" else "target_layer_ids"
        raise ExportCheckError(key, f"config.json reads target layers {list(spec.target_layer_ids)} "
                                    f"(as hidden_states[id + 1]); the drafter was trained on {trained_ids}")
    for key in ("block_size", "mask_token_id"):
        if getattr(spec, key) != manifest[key]:
            raise ExportCheckError(key, f"config.json says {getattr(spec, key)}, the drafter was trained with "
                                        f"{manifest[key]}")
    n = int(manifest["target"]["num_layers"])
    if max(spec.target_layer_ids) >= n:
        raise ExportCheckError("target_layer_ids", f"{list(spec.target_layer_ids)} exceed the target's {n} layers")


def _check_tensors(tensors: dict[str, torch.Tensor], want: dict[str, tuple[int, ...]], layout: ExportFormat) -> None:
    missing = sorted(set(want) - set(tensors))
    if missing:
        raise ExportCheckError(WEIGHTS, f"missing tensor {missing[0]}" + (f" (+{len(missing) - 1} more)"
                                                                         if len(missing) > 1 else ""))
    extra = sorted(set(tensors) - set(want))
    if extra:
        why = " (a z-lab export holds nothing of the target)" if layout.name == "zlab" else ""
        raise ExportCheckError(WEIGHTS, f"unexpected tensor {extra[0]}{why}")
    for name, shape in want.items():
        if tuple(tensors[name].shape) != shape:
            raise ExportCheckError(name, f"shape {list(tensors[name].shape)}, but config.json implies {list(shape)}")


def _check_reference(out: Path, layout: ExportFormat, spec: DrafterSpec, tensors: dict[str, torch.Tensor]) -> Reference:
    from safetensors.torch import load_file

    try:
        ref = Reference.from_tensors(load_file(str(out / REFERENCE_FILE)))
    except (OSError, KeyError) as exc:
        raise ExportCheckError(REFERENCE_FILE, f"missing or unreadable ({exc})") from None
    embed, head = _meta_tables(spec)
    drafter = DFlashDrafter(spec, embed, head)
    drafter.load_state_dict({k: v.float() for k, v in _body(tensors, layout, spec).items()}, strict=True)
    hidden = run_drafter(drafter, ref.context, ref.block_embeddings)
    problem = (compare("reference hidden states", hidden, ref.hidden)
               or compare("reference logits", row_logits(hidden, ref.head_rows), ref.logits))
    if "embed_tokens.weight" in tensors:  # a layout that carries the target's tables: they must be its
        problem = problem or compare("embed_tokens.weight (reference rows)",
                                     tensors["embed_tokens.weight"][ref.block_ids[0]].float()[None],
                                     ref.block_embeddings)
        problem = problem or compare("lm_head.weight (reference rows)",
                                     tensors["lm_head.weight"][ref.vocab_rows].float(), ref.head_rows)
    if problem:
        raise ExportCheckError(*problem.split(": ", 1))
    return ref


def check_export(out: str | Path, *, independent: bool = True) -> CheckReport:
    """Check an export from its files alone (module docstring, step 2), then the independent reader
    (step 3) unless ``independent`` is False. Raises :class:`ExportCheckError` at the first failure."""
    from dflash.model.export_independent import independent_check

    out = Path(out)
    manifest = read_manifest(out)
    layout = FORMATS[manifest["format"]]
    report = CheckReport()
    spec = _parse_config(out, layout)
    _check_against_manifest(spec, manifest, layout)
    report.add("config.json: capture layers, block size, MASK id as trained", "ok",
               f"target_layer_ids {list(spec.target_layer_ids)}, block_size {spec.block_size}")
    if not (out / WEIGHTS).is_file():
        raise ExportCheckError(WEIGHTS, "missing")
    tensors = _load_tensors(out)
    _check_tensors(tensors, expected_shapes(layout, spec), layout)
    report.add("tensors: every one the config implies, shapes, nothing else", "ok", f"{len(tensors)} tensors")
    _check_reference(out, layout, spec, tensors)
    report.add("reference output reproduced from the export alone", "ok")
    for name, digest in manifest["files"].items():
        if not (out / name).is_file():
            raise ExportCheckError(name, "missing")
        if sha256_of(out / name) != digest:
            raise ExportCheckError(name, "sha256 differs from the manifest's (the file changed after export)")
    report.add("sha256 of every file", "ok", ", ".join(manifest["files"]))
    if independent:
        status, detail = independent_check(out, layout.name, manifest["target"]["source"])
        report.add("independent reader (speculators)", status, detail)
    return report


__all__ = ["CheckReport", "check_export", "expected_shapes", "export_drafter", "read_manifest",
           "saved_drafter", "target_info"]
