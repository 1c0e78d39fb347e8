#!/bin/bash
# The demo's cold and warm wall times on a fresh clone of main (issue #32 item 6).
set -u
# run from an environment where `bash scripts/install.sh` has run (the clone's code is put first on PYTHONPATH)
rm -rf /tmp/democlone /tmp/demo-cold /tmp/demo-warm2 /tmp/democache
git clone -q "${1:-$(git -C "$(dirname "$0")" rev-parse --show-toplevel)}" /tmp/democlone && cd /tmp/democlone || exit 1
echo "main at $(git rev-parse --short HEAD)"
export PYTHONPATH=/tmp/democlone WANDB_MODE=offline HF_HUB_OFFLINE=1 MPLCONFIGDIR=/tmp/democache/mpl HF_HOME=/tmp/democache/hf
mkdir -p /tmp/democache
sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null && echo "page cache dropped" || echo "page cache not droppable here"
date -u; uptime
DFLASH_CACHE_DIR=/tmp/democache /usr/bin/time -v dflash demo --out /tmp/demo-cold > /tmp/demo-cold.log 2> /tmp/demo-cold.err
echo "cold rc $?"; date -u; uptime
DFLASH_CACHE_DIR=/tmp/democache /usr/bin/time -v dflash demo --out /tmp/demo-warm2 > /tmp/demo-warm2.log 2> /tmp/demo-warm2.err
echo "warm rc $?"; date -u; uptime
for f in cold warm2; do echo "== $f"; grep -E "Elapsed|User time|System time|Maximum resident" /tmp/demo-$f.err; grep -E "^stages|^done in" /tmp/demo-$f.log; tail -2 /tmp/demo-$f.log; done
