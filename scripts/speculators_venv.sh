#!/usr/bin/env bash
# Create the virtual environment in which `dflash export` runs its independent reader (vLLM's
# `speculators` package), and print the path of its python.
#
# Why a venv of its own: speculators 0.9.0 pins transformers <= 5.19 and torch <= 2.14.1 and pulls
# torchvision/torchaudio/datasets/hs-connectors, none of which the reader needs; dflash itself runs
# a newer transformers. So: the CPU torch (or the one already on disk), transformers 5.19, the
# speculators wheel with --no-deps, and only the packages its DFlash model and converter import.
# Nothing of dflash is installed there: the reader (dflash/model/export_reader_speculators.py) is
# a standalone script.
#
# Usage: bash scripts/speculators_venv.sh [DIR]
#   DIR defaults to $DFLASH_SPECULATORS_VENV, else ~/.cache/dflash/speculators-venv. Re-running on
#   a complete venv does nothing. `dflash export` finds it at the same default (or through
#   DFLASH_SPECULATORS_VENV) and otherwise skips the independent check, saying why.
set -euo pipefail
VENV="${1:-${DFLASH_SPECULATORS_VENV:-$HOME/.cache/dflash/speculators-venv}}"
PY="${PYTHON:-python3}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import speculators.convert.dflash, speculators.models.dflash" \
    2>/dev/null; then
  echo "$VENV/bin/python"
  exit 0
fi
rm -rf "$VENV"
"$PY" -m venv "$VENV"
pip_() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@"; }
LOCAL_TORCH="$(ls /opt/wheels/torch-2.1[0-4].*+cpu-*.whl 2>/dev/null | tail -n 1 || true)"
if [ -n "$LOCAL_TORCH" ]; then
  pip_ "$LOCAL_TORCH"  # the CPU build on local disk; its small dependencies come from the index
else
  pip_ --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple \
    "torch>=2.9,<=2.14.1"
fi
# What `import speculators` pulls in at its top (its package __init__ reaches the training data
# code: openai, datasets, hs-connectors), with speculators' own pins.
pip_ "transformers>=5.0,<=5.19.0" "safetensors" "loguru>=0.7.2,<=0.7.3" "pydantic>=2" "pydantic-settings>=2" \
  "numpy>=2,<=2.5.4" "huggingface-hub" "typing-extensions" "openai>=2" "datasets>=4,<=5.1.0" \
  "tqdm>=4.66.3,<=4.70.1" "hs-connectors==0.9.0"
pip_ --no-deps "speculators==0.9.0"
"$VENV/bin/python" -c "import speculators.convert.dflash, speculators.models.dflash" >&2
echo "$VENV/bin/python"
