"""``dflash report``: One self-contained HTML report and its Markdown twin (reports/)."""

from __future__ import annotations

import argparse

from dflash.cli.options import Opt, Verb
from dflash.core.config import DflashConfig


def handle(args: argparse.Namespace, cfg: DflashConfig) -> int:
    """One self-contained HTML report and its Markdown twin (reports/)."""
    from reports.build import handle

    return handle(args, cfg)


VERB = Verb("HTML + Markdown comparison report", opts=(
        Opt("INPUT", "inpath", "run directories, records or study files", required=True, repeat=True),
        Opt("--out", "outdir", "output directory", metavar="DIR"),
    ))
