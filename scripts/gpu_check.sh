#!/usr/bin/env bash
# GPU acceptance run: `dflash gpu-check` (dflash/gpucheck; `dflash gpu-check --help`) with a 5-minute box.
# Its own --time-limit (300 s) stops the running verb 15 s early and writes the JSON; `timeout` is a
# backstop above it (SIGTERM, on which the check also writes its JSON; SIGKILL 20 s later).
# Flags pass through: --target, --data, --minutes, --keep, --learning, --regenerate-prompts N, --cpu, --arch.
# Usage: bash scripts/gpu_check.sh [--json FILE] [FLAGS]   (JSON default: gpu_check.json, or $GPU_CHECK_JSON)
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
JSON="${GPU_CHECK_JSON:-gpu_check.json}"
ARGS=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--json" ] && [ $# -ge 2 ]; then JSON="$2"; shift 2; else ARGS+=("$1"); shift; fi
done
exec timeout --kill-after=20 330 python3 scripts/gpu_check.py --json "$JSON" --time-limit "${GPU_CHECK_LIMIT_S:-300}" \
  ${ARGS[@]+"${ARGS[@]}"}
