"""``dflash regenerate``: Target-regenerated replies for the configured data set (dflash/regenerate.py)."""

from __future__ import annotations

import argparse

from dflash.cli.options import Opt, Verb
from dflash.core.config import DflashConfig


def handle(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """Target-regenerated replies for the configured data set (dflash/regenerate.py)."""
    from dflash.regenerate import handle

    return handle(args, cfg)


VERB = Verb("regenerate the data set's replies with the target (ShareGPT JSONL out)", opts=(
        Opt("--out", "outfile", "ShareGPT-format JSONL to write or extend", required=True, metavar="DATA.jsonl"),
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
        Opt("--concurrency", "int", "requests in flight (server back end, >= 1)", lo=1, metavar="N"),
        Opt("--retries", "int", "retries of a failed request (server back end, >= 0)", lo=0, metavar="N"),
        Opt("--timeout", "float", "seconds per request (server back end, > 0)", lo=0, metavar="S"),
        Opt("--device", "str", "device of the transformers back end (default: the config's first target device)",
            metavar="DEV"),
    ))
