#!/usr/bin/env bash
# Measures what token leasing (`--token-batch`) spares Redis, and what it costs the server.
# Usage: scripts/token-batches.sh [seconds] [rounds] [batch]
# One redis-server and one `tollgate serve` at a time, on free loopback ports, killed on exit.
# A policy of 1,000,000 a minute per user, so that nearly every check passes; `tollgate bench`
# over HTTP at 16 workers checks one key, then 10,000 keys drawn Zipf (a few hot keys, a long
# cold tail). Each round runs the server with batches of at most `batch` tokens (default 256)
# and without, alternated, each on an emptied Redis; per run: checks/s, the share rejected,
# script calls per check (INFO commandstats), Redis' CPU per check and the p99 latency.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
rounds=${2:-2}
batch=${3:-256}
# shellcheck source=scripts/tollgate-bin.sh
source scripts/tollgate-bin.sh
work=$(mktemp -d)
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT

rport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
redis-server --port "$rport" --bind 127.0.0.1 --save "" --appendonly no >"$work/redis.log" 2>&1 &
pids+=($!)
until redis-cli -p "$rport" ping >/dev/null 2>&1; do sleep 0.1; done
cat >"$work/policy.yaml" <<'YAML'
version: "busy"
limits:
  - name: per-user
    domain: api
    key: [user]
    capacity: 1000000
    refill: 1000000/m
YAML

stat() { redis-cli -p "$rport" INFO "$1" | tr -d '\r'; }
printf '%-6s %-12s %9s %9s %12s %14s %8s\n' batch keys checks/s rejected calls/check "redis CPU µs" "p99 ms"
for _ in $(seq "$rounds"); do
  for tokens in "$batch" 0; do
    for keys in "1 uniform" "10000 zipf"; do
      read -r count distribution <<<"$keys"
      redis-cli -p "$rport" FLUSHALL >/dev/null
      redis-cli -p "$rport" CONFIG RESETSTAT >/dev/null
      $B serve --config "$work/policy.yaml" --store "redis://127.0.0.1:$rport" \
        --http 127.0.0.1:0 --grpc 127.0.0.1:0 --token-batch "$tokens" >"$work/server.out" 2>&1 &
      server=$!
      pids+=($server)
      until grep -q '^listening' "$work/server.out" 2>/dev/null; do sleep 0.1; done
      http=$(sed -E 's/.*http=([^ ]+).*/\1/' <<<"$(grep '^listening' "$work/server.out")")
      cpu_before=$(stat cpu | awk -F: '/used_cpu_(sys|user):/{s+=$2} END{print s}')
      out=$($B bench --target "http://$http" --keys "$count" --distribution "$distribution" \
        -c 16 -d "${secs}s" --json 2>/dev/null)
      cpu_after=$(stat cpu | awk -F: '/used_cpu_(sys|user):/{s+=$2} END{print s}')
      calls=$(stat commandstats | awk -F'[=,:]' '/^cmdstat_eval(sha)?:/{s+=$3} END{print s+0}')
      kill "$server"
      wait "$server" 2>/dev/null || true
      python3 - "$tokens" "$count $distribution" "$calls" "$cpu_before" "$cpu_after" "$out" <<'PY'
import json, sys
tokens, keys, calls, before, after, out = sys.argv[1:]
r = json.loads(out)
checks = r["allowed"] + r["rejected"]
print(f'{tokens if tokens != "0" else "off":<6} {keys:<12} {r["decisions_per_s"]:>9.0f} '
      f'{r["rejected"] / max(checks, 1):>9.3f} {float(calls) / max(checks, 1):>12.4f} '
      f'{(float(after) - float(before)) * 1e6 / max(checks, 1):>14.2f} '
      f'{r["latency_us"]["p99"] / 1000:>8.3f}')
PY
    done
  done
done
