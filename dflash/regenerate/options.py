"""The verb's flags as one frozen :class:`Options`, and the checks the CLI's option table cannot express.

The table in :mod:`dflash.cli.verbs.regenerate` judges each flag alone (kinds, ``>= 1`` counts,
``--timeout > 0``, finite numbers, choices). What it cannot see lives here, in :func:`check_flags`,
the one place: a flag that belongs to the other back end, ``--top-p`` without sampling, the closed
ranges of ``--temperature`` and ``--top-p``, the server URL's shape, a device that exists, the
files beside ``--out``, and the ``server`` extra being installed. A flag that does nothing would
still end up in the sidecar as if it had mattered, so those are rejected rather than ignored.
Torch-free at import (the device check imports torch when it runs).
"""

from __future__ import annotations

import argparse
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from dflash.core.config import DflashConfig, check_float
from dflash.core.errors import ConfigError
from dflash.data.regenerated_cache import cache_path, failed_path, sidecar_path, work_path

EXTRA = "pip install 'dflash-tune[server]'"
DEFAULT_BATCH_SIZE = 8
DEFAULT_CONCURRENCY = 8
DEFAULT_RETRIES = 3
DEFAULT_TIMEOUT_S = 600.0
# (argparse dest, flag) of the flags that only one back end reads.
SERVER_ONLY = (("server_model", "--server-model"), ("concurrency", "--concurrency"), ("retries", "--retries"),
               ("timeout", "--timeout"), ("url", "--url"))
LOCAL_ONLY = (("batch_size", "--batch-size"), ("device", "--device"))


@dataclass(frozen=True)
class Options:
    """The verb's flags, validated, with defaults filled in (None: does not apply to the back end)."""

    out: Path  # where this run writes (in cache mode: the cache's work file)
    backend: str
    turns: str
    limit: int | None
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    url: str | None = None
    server_model: str | None = None
    concurrency: int = DEFAULT_CONCURRENCY
    retries: int = DEFAULT_RETRIES
    timeout: float = DEFAULT_TIMEOUT_S
    batch_size: int = DEFAULT_BATCH_SIZE
    device: str | None = None
    publish_to: Path | None = None  # cache mode (no --out): the cache file a finished run is moved to

    @property
    def sampling(self) -> bool:
        return self.temperature > 0


# --------------------------------------------------------------------------- checks (Verb.check)
def check_flags(args: argparse.Namespace) -> None:
    """What one flag's own check cannot judge; raises ConfigError (one line, exit 2) before anything runs."""
    if args.out is not None:  # without --out: the cache, whose place needs the config (options_from)
        _check_out_files(Path(str(args.out)).expanduser(), str(args.out))
    _check_backend_flags(args)
    _check_decoding(args.temperature, args.top_p)
    if args.backend == "server":
        _check_url(args.url)
        require_openai()
    elif args.device is not None:
        check_device("--device", str(args.device))


def _check_out_files(out: Path, given: str) -> None:
    """The table checks that ``--out`` is no directory; its parent and the two files beside it matter too."""
    if out.parent.exists() and not out.parent.is_dir():
        raise ConfigError("--out", "its parent must be a directory", given)
    for p in (out, sidecar_path(out), failed_path(out)):
        if p.exists() and not p.is_file():
            raise ConfigError("--out", f"{p.name} exists and is not a regular file", given)


def _check_backend_flags(args: argparse.Namespace) -> None:
    wrong, other = (SERVER_ONLY, "server") if args.backend == "transformers" else (LOCAL_ONLY, "transformers")
    for dest, flag in wrong:
        value = getattr(args, dest)
        if value is not None:
            raise ConfigError(flag, f"only applies to --backend {other}", value)


def _check_decoding(temperature: float | None, top_p: float | None) -> None:
    if temperature is not None:
        check_float("--temperature", temperature, 0)
    if top_p is not None:
        check_float("--top-p", top_p, 0, 1, lo_open=True)
        if not temperature:
            raise ConfigError("--top-p", "only applies when sampling: give --temperature > 0 too (greedy ignores it)",
                              top_p)


def _check_url(url: str | None) -> None:
    if url is None:
        raise ConfigError("--url", "required with --backend server: the server's base URL, e.g. "
                          "http://127.0.0.1:8000", show_got=False)
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ConfigError("--url", "must be an http:// or https:// URL with a host, e.g. http://127.0.0.1:8000", url)
    try:
        parts.port  # noqa: B018 (raises ValueError on a bad port)
    except ValueError:
        raise ConfigError("--url", "has an invalid port", url) from None


def require_openai() -> ModuleType:
    """The ``openai`` module, or the one-line error (exit 2) that names the extra to install.

    It lives with the flag checks (the server back end calls it too) so the check never imports the back end."""
    try:
        import openai
    except ImportError:
        raise ConfigError("--backend", f"server needs the openai client library: {EXTRA}", show_got=False) from None
    return openai


def check_device(key: str, dev: str) -> str:
    """A torch device string that exists on this machine (a missing GPU is bad input, not a crash later)."""
    import torch

    try:
        d = torch.device(dev.strip())
    except (RuntimeError, ValueError):
        raise ConfigError(key, "must be a torch device such as cpu, cuda or cuda:1", dev) from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(key, "names a CUDA device but CUDA is not available here", dev)
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ConfigError(key, f"no such CUDA device ({torch.cuda.device_count()} visible)", dev)
    elif d.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(key, "names an MPS device but MPS is not available here", dev)
    return str(d)


# --------------------------------------------------------------------------- checked flags -> Options
def server_base_url(url: str) -> str:
    """``http(s)://host[:port][/prefix]`` without a trailing ``/v1`` (or ``/v1/chat/completions``):
    users paste any of the three forms, the endpoints are appended here."""
    base = url.strip().rstrip("/")
    for suffix in ("/chat/completions", "/v1"):
        if base.endswith(suffix):
            base = base[: -len(suffix)].rstrip("/")
    return base


def _destination(args: argparse.Namespace, cfg: DflashConfig) -> dict[str, Path]:
    """``--out`` as given, or the cache of the configured target (written in its work file, then published)."""
    if args.out is not None:
        return {"out": Path(str(args.out)).expanduser()}
    published = cache_path(cfg.target.model)
    return {"out": work_path(published), "publish_to": published}


def options_from(args: argparse.Namespace, cfg: DflashConfig) -> Options:
    """The flags :func:`check_flags` and the option table passed, with the config's defaults filled in."""
    temperature = float(args.temperature) if args.temperature is not None else 0.0
    common = {**_destination(args, cfg), "backend": args.backend, "turns": args.turns,
              "limit": args.limit, "temperature": temperature,
              "max_new_tokens": int(args.max_new_tokens or cfg.workload.max_len),
              "top_p": float(args.top_p) if args.top_p is not None else 1.0, "seed": int(cfg.seed)}
    if args.backend == "server":
        given = {dest: getattr(args, dest) for dest, _ in SERVER_ONLY if getattr(args, dest) is not None}
        given["url"] = server_base_url(args.url)
        if "server_model" in given:
            given["server_model"] = given["server_model"].strip()
        return Options(**common, **given)
    batch = {"batch_size": args.batch_size} if args.batch_size is not None else {}
    device = check_device("--device", args.device) if args.device is not None else \
        check_device("target.devices", cfg.target.devices[0])
    return Options(**common, **batch, device=device)
