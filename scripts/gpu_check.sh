#!/usr/bin/env bash
# GPU check (issue #4): the pipeline on a GPU machine that has torch and transformers only.
# Random 1B-class Llama target, synthetic token ids, W&B off, ~2 minutes of training, < 4 minutes total.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 230 python3 scripts/gpu_check.py --arch 1b --seconds 120 "$@"
