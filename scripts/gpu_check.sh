#!/usr/bin/env bash
# GPU check (issues #4, #14): the distributed trainer on the GPUs present, on a machine that has torch,
# transformers and tokenizers only (run from a checkout; nothing is installed). 2+ GPUs: half target, half
# drafter ranks, NCCL point-to-point; 1 GPU: 1 target + 1 drafter rank sharing it (host-memory data plane).
# Random 1B-class Llama target, synthetic conversations, W&B off, 2 minutes of training, < 4 minutes total.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 235 python3 scripts/gpu_check.py --arch 1b --minutes 2 "$@"
