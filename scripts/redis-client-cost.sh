#!/usr/bin/env bash
# Counts the client's instructions per decision on the Redis store's path (RedisStore::check:
# keys, batching, the command, the multiplexed connection, the reply), beside a raw EVALSHA of
# `return 1` through redis-rs, under callgrind: unlike a rate, the count does not move with the
# host's load. Usage:
#   scripts/redis-client-cost.sh [callers ...]        (default: 1 16 64)
# Each figure is (instructions of a run of N decisions - those of a run of 0) / N, so setup is
# left out. redis-server itself is not counted (see scripts/redis-script-cost.sh for that).
# Needs valgrind; the driver starts its own redis-server on a free loopback port.
set -euo pipefail
cd "$(dirname "$0")/.."
(($# > 0)) || set -- 1 16 64
command -v valgrind >/dev/null || { echo "valgrind is needed (apt-get install -y valgrind)" >&2; exit 1; }
cargo build --release -q -p tollgate-bench --bin redis-client-cost
bin=target/release/redis-client-cost
n=${DECISIONS:-20000}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
count() {
  valgrind --tool=callgrind --callgrind-out-file="$work/cg.out" "$bin" "$@" >/dev/null 2>"$work/log"
  sed -n 's/.*Collected : \([0-9]*\).*/\1/p' "$work/log"
}
echo "| callers | tollgate instructions per decision | \`return 1\` instructions per call |"
echo "|---|---|---|"
for callers in "$@"; do
  base=$(count 0 "$callers" tollgate)
  ours=$(count "$n" "$callers" tollgate)
  raw=$(count "$n" "$callers" return1)
  base_raw=$(count 0 "$callers" return1)
  echo "| $callers | $(((ours - base) / n)) | $(((raw - base_raw) / n)) |"
done
