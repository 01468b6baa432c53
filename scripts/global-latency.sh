#!/usr/bin/env bash
# What a global limit costs a request when the global store is in another region, beside the
# same limit decided on that store request by request, and on the local memory store, in one
# run. Usage: scripts/global-latency.sh [one-way-ms] [seconds] [rounds] [keys]
# Starts its own redis-server, a delay-proxy in front of it (ONE-WAY-MS each way: the other
# region) and three servers on free loopback ports; kills them on exit. Each round runs
# `tollgate bench` (16 workers, KEYS users, unpaced) against each server in turn:
#   local   --store memory, the limit regional (the floor: no store call at all);
#   far     --store (the far Redis), the limit regional: every check a cross-region call;
#   global  --store memory --global-store (the far Redis), the limit `scope: global`.
# The limit is generous, so latency is all that differs: what a check waits for.
set -euo pipefail
cd "$(dirname "$0")/.."
delay=${1:-25}
secs=${2:-5}
rounds=${3:-3}
keys=${4:-100}
# shellcheck source=scripts/tollgate-bin.sh
source scripts/tollgate-bin.sh
cargo build --release -q -p tollgate-bench --bin delay-proxy
work=$(mktemp -d)
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT

# shellcheck source=scripts/scratch-redis.sh
source scripts/scratch-redis.sh
scratch_redis
target/release/delay-proxy 0 "127.0.0.1:$rport" "$delay" >"$work/proxy.out" 2>&1 &
pids+=($!)
until grep -q '^listening' "$work/proxy.out" 2>/dev/null; do sleep 0.1; done
far=redis://127.0.0.1:$(awk '/^listening/ {print $2}' "$work/proxy.out")

limit='{name: per-user, domain: api, key: [user], capacity: 100000, refill: 50000/s'
echo "limits: [$limit}]" >"$work/regional.yaml"
echo "limits: [$limit, scope: global}]" >"$work/global.yaml"

declare -A http server_pid
start() {
  local name=$1; shift
  $B serve --http 127.0.0.1:0 --grpc 127.0.0.1:0 "$@" >"$work/$name.out" 2>&1 &
  server_pid[$name]=$!
  pids+=($!)
  until grep -q '^listening' "$work/$name.out" 2>/dev/null; do sleep 0.1; done
  http[$name]=$(sed -E 's/.*http=([^ ]+).*/\1/' <<<"$(grep '^listening' "$work/$name.out")")
}
start local --config "$work/regional.yaml"
start far --config "$work/regional.yaml" --store "$far" --store-timeout 2s
start global --config "$work/global.yaml" --global-store "$far" --global-store-timeout 2s

cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
measure() {
  local name=$1 round=$2 before after out
  before=$(cpu "${server_pid[$name]}")
  out=$($B bench --target "http://${http[$name]}" -c 16 -d "${secs}s" --keys "$keys" --json)
  after=$(cpu "${server_pid[$name]}")
  python3 - "$name" "$round" "$before" "$after" "$out" <<'PY'
import json, os, sys
name, round_, before, after, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
tick = os.sysconf("SC_CLK_TCK")
units = out["allowed"] + out["rejected"] + out["errors"]
lat = out["latency_us"]
server_us = (after - before) / tick * 1e6 / max(units, 1)
print(f"| {name} (round {round_}) | {out['decisions_per_s']:,.0f} | {lat['p50']/1000:.3f} | "
      f"{lat['p99']/1000:.3f} | {lat['p99_9']/1000:.3f} | {server_us:.2f} | "
      f"{out['allowed']:,} / {out['rejected']:,} / {out['errors']:,} |")
PY
}
echo "one-way delay to the global store: ${delay} ms; ${keys} users; 16 workers; ${secs} s a run"
echo
echo "| server | checks/s | p50 ms | p99 ms | p99.9 ms | server CPU µs/check | allowed / rejected / errors |"
echo "|---|---|---|---|---|---|---|"
for round in $(seq "$rounds"); do
  for name in local far global global; do
    measure "$name" "$round"
  done
done
fetched=$(curl -s "http://${http[global]}/metrics" | awk '/^tollgate_global_fetched_tokens_total/ {print $2}')
echo
echo "global server: ${fetched:-0} tokens fetched from the global store in all"
