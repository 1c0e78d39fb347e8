"""``dflash export``: the trained drafter in a serving engine's layout, checked on load.

``dflash export --drafter RUN_DIR --out DIR [--format zlab|speculators]`` writes the export
(:mod:`dflash.model.export`) and prints its checks and the serving commands; ``dflash export
--check DIR`` re-runs the checks on an existing export without the run. Bad input is one line and
exit status 2 before anything is written; an export that fails a check is one line naming what is
wrong and exit status 1 (a failed export leaves nothing at ``--out``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dflash.cli.options import Opt, Verb
from dflash.cli.runs import drafter_dirs
from dflash.core.config import DflashConfig
from dflash.core.errors import ConfigError

FORMAT_NAMES = ("zlab", "speculators")
CHECK_FAILED = 1


def _check_flags(args: argparse.Namespace, overrides: dict[str, Any]) -> None:
    if (args.drafter is None) == (args.check is None):
        raise ConfigError("--drafter/--check", "give exactly one: --drafter RUN_DIR --out DIR to export, "
                          "or --check DIR to check an export", show_got=False)
    if args.check is not None:
        for flag, value in (("--out", args.out), ("--format", args.format)):
            if value is not None:
                raise ConfigError(flag, "only with --drafter (--check reads the format from the export)", value)
        return
    if args.out is None:
        raise ConfigError("--out", "required with --drafter: the directory to write the export into",
                          show_got=False)
    out = Path(args.out)
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError("--out", "must be a new or empty directory (an export is never written over)", args.out)
    run_dir, _ = drafter_dirs(Path(args.drafter))
    if not (run_dir / "config.json").is_file():
        raise ConfigError("--drafter", "must be inside a dflash train run directory (its config.json names "
                          "the target)", args.drafter)


def checkpoint_dir(target_model: str, source: str) -> str:
    """Where transformers loads the target from: the source itself, or for a GGUF target the
    float32 safetensors conversion :mod:`dflash.data.model_source` cached (when it did)."""
    from dflash.data.cache_dir import default_cache_dir
    from dflash.data.model_source import find_model, gguf_cache_entry

    gguf = find_model(target_model).gguf
    if gguf is None:
        return source
    entry = gguf_cache_entry(gguf, default_cache_dir())
    return str(entry) if (entry / "config.json").is_file() else source


def _print_report(title: str, report: Any) -> None:
    print(title)
    for line in report.lines():
        print(line)


def _export(args: argparse.Namespace) -> int:
    from dflash.cli.runs import load_run_config
    from dflash.model.export import export_drafter, read_manifest
    from dflash.model.export_reference import ExportCheckError
    from dflash.model.export_serving import serving_commands
    from dflash.model.target import load_target

    run_dir, drafter_dir = drafter_dirs(Path(args.drafter))
    run_cfg = load_run_config(run_dir)
    fmt = args.format or "zlab"
    target = load_target(run_cfg.target.model, device="cpu")
    out = Path(args.out)
    try:
        report = export_drafter(drafter_dir, out, fmt, model=target.model, tokenizer=target.tokenizer,
                                target_model=run_cfg.target.model,
                                target_source=checkpoint_dir(run_cfg.target.model, target.source), run_dir=run_dir)
    except ExportCheckError as exc:
        print(f"dflash export: check failed: {exc} (nothing written at {out})", file=sys.stderr)
        return CHECK_FAILED
    _print_report(f"export: {out} ({fmt} layout), checked on load:", report)
    manifest = read_manifest(out)
    print("serve it:")
    for engine, cmd in serving_commands(str(out.resolve()), run_cfg.target.model, manifest["block_size"], fmt).items():
        print(f"  {engine}: {cmd}")
    return 0


def _check(path: Path) -> int:
    from dflash.model.export import check_export
    from dflash.model.export_reference import ExportCheckError

    try:
        report = check_export(path)
    except ExportCheckError as exc:
        print(f"dflash export: check failed: {exc}", file=sys.stderr)
        return CHECK_FAILED
    _print_report(f"export {path}: every check passed", report)
    return 0


def handle(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """Export a run's drafter (``--drafter``), or check an existing export (``--check``)."""
    if args.check is not None:
        return _check(Path(args.check))
    return _export(args)


VERB = Verb("the trained drafter in a serving engine's layout (z-lab/SGLang/vLLM or speculators), checked on load",
            check=_check_flags, opts=(
                Opt("--drafter", "indir", "run directory of dflash train (or its drafter/ directory)",
                    metavar="RUN_DIR"),
                Opt("--out", "outdir", "new or empty directory to write the export into", metavar="DIR"),
                Opt("--format", "choice", "layout: zlab (SGLang, vLLM; default) or speculators",
                    choices=FORMAT_NAMES, metavar="{" + ",".join(FORMAT_NAMES) + "}"),
                Opt("--check", "indir", "check an existing export instead (exit 1 naming what is wrong)",
                    metavar="DIR"),
            ))
