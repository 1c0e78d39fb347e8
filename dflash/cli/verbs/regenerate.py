"""``dflash regenerate``: target-regenerated replies for the configured data set (dflash/regenerate/).

The table below judges each flag alone; what it cannot express (flags of the other back end,
``--top-p`` without sampling, closed ranges, the URL, the device, the ``server`` extra) is
:func:`dflash.regenerate.options.check_flags`, run as this verb's check before the config loads.
"""

from __future__ import annotations

import argparse
from typing import Any

from dflash.cli.options import Opt, Verb
from dflash.core.config import DflashConfig


def handle(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """Target-regenerated replies for the configured data set (dflash/regenerate/run.py)."""
    from dflash.regenerate.run import handle

    return handle(args, cfg)


def _check(args: argparse.Namespace, overrides: dict[str, Any]) -> None:
    from dflash.regenerate.options import check_flags

    check_flags(args)


VERB = Verb("regenerate the data set's replies with the target (ShareGPT JSONL out)", check=_check, opts=(
        Opt("--out", "outfile", "ShareGPT-format JSONL to write or extend (default: the target's cache, "
            "<cache dir>/regenerated/<target>.jsonl, published when complete; dataset = \"auto\" trains on it)",
            metavar="DATA.jsonl"),
        Opt("--backend", "choice", "who generates: local transformers generate, or an OpenAI-compatible server",
            choices=("transformers", "server"), default="transformers", metavar="{transformers,server}"),
        Opt("--url", "str", "base URL of the OpenAI-compatible server (with --backend server)", metavar="URL"),
        Opt("--server-model", "str", "model name sent to the server (default: the server's first model)",
            metavar="NAME"),
        Opt("--turns", "choice", "which user turns get a regenerated reply", choices=("first", "all"),
            default="first", metavar="{first,all}"),
        Opt("--limit", "int", "only the first N usable records of the data set, done ones included (>= 1)", lo=1,
            metavar="N"),
        Opt("--max-new-tokens", "int", "bound on each reply's new tokens (>= 1)", lo=1, metavar="N"),
        Opt("--temperature", "float", "sampling temperature; 0 = greedy (>= 0)", metavar="T"),
        Opt("--top-p", "float", "nucleus sampling mass (0 < P <= 1)", metavar="P"),
        Opt("--batch-size", "int", "prompts per generate call (transformers back end, >= 1)", lo=1, metavar="N"),
        Opt("--concurrency", "int", "records in flight (server back end, >= 1)", lo=1, metavar="N"),
        Opt("--retries", "int", "retries of a failed request (server back end, >= 0)", lo=0, metavar="N"),
        Opt("--timeout", "float", "seconds per request (server back end, > 0)", lo=0, metavar="S"),
        Opt("--device", "str", "device of the transformers back end (default: the config's first target device)",
            metavar="DEV"),
    ))
