#!/usr/bin/env bash
# GPU acceptance run (issue #25 item 6): regenerate -> train -> eval -> calibrate -> predict and run a
# second configuration, through the real dflash verbs, on the GPUs present (2+: half target, half drafter
# ranks, NCCL; 1: a target and a drafter rank share it). No network: the packaged SmolLM2 + ShareGPT where
# installed, else a random 1B Llama and synthetic conversations. Two 1-minute training runs, <= 5 minutes.
# --learning (issue #27): regenerate 1,600 prompts (--regenerate-prompts N), train the learning profile
# (examples/gpu-smollm2-learning.toml) for 1.5 minutes with the held-out metric, eval tau on 32 prompts; <= 5 minutes.
# Flags pass through: --target, --data, --minutes, --json FILE, --keep, --learning, --regenerate-prompts N
# (see python3 scripts/gpu_check.py -h).
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 330 python3 scripts/gpu_check.py --json "${GPU_CHECK_JSON:-gpu_check.json}" "$@"
