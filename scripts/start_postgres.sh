#!/usr/bin/env bash
# Start a throwaway PostgreSQL server on loopback (for the multi-machine sweep test) and print its URL.
# Installs Debian's postgresql package first where it is missing. Idempotent: a running server is reused.
set -euo pipefail
if [ ! -d /usr/lib/postgresql ] || ! id postgres >/dev/null 2>&1; then
  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
fi
VER=$(ls /usr/lib/postgresql | sort -n | tail -1)
BIN=/usr/lib/postgresql/$VER/bin
DATA=${DFLASH_PG_DIR:-/tmp/dflash-pg}
PORT=${DFLASH_PG_PORT:-55432}
if [ ! -f "$DATA/PG_VERSION" ]; then
  rm -rf "$DATA" && mkdir -p "$DATA" && chown postgres "$DATA"
  su postgres -c "$BIN/initdb -D $DATA -A trust -U postgres" >/dev/null
fi
if ! su postgres -c "$BIN/pg_ctl -D $DATA status" >/dev/null 2>&1; then
  su postgres -c "$BIN/pg_ctl -D $DATA -o '-p $PORT -k /tmp -c listen_addresses=127.0.0.1' -l $DATA/log -w start" >/dev/null
fi
if ! psql -h 127.0.0.1 -p "$PORT" -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname='dflash'" | grep -q 1; then
  psql -h 127.0.0.1 -p "$PORT" -U postgres -c "CREATE DATABASE dflash" >/dev/null
fi
echo "postgresql://postgres@127.0.0.1:$PORT/dflash"
