"""Thin wrapper: ``python3 scripts/gpu_check.py ARGS`` is ``dflash gpu-check ARGS`` (dflash/gpucheck).

Kept for the commands already written down (``bash scripts/gpu_check.sh --json F``); the check
itself lives in the package so an installed wheel has it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's dflash, not another install

from dflash.cli import main

if __name__ == "__main__":
    sys.exit(main(["gpu-check", *sys.argv[1:]]))
