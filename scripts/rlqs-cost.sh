#!/usr/bin/env bash
# What an RLQS bucket report costs `tollgate serve`, beside an RLS check on the same server,
# in one run. Usage: scripts/rlqs-cost.sh [memory|redis] [seconds] [rounds] [streams] [buckets]
# Starts its own server (and redis-server for `redis`) on free loopback ports; kills them on
# exit. Each round runs, one after the other, RLS checks (`tollgate bench --grpc`, 16 workers
# multiplexed over 2 connections, as Envoy sends them) and RLQS reports (`rlqs-load`: STREAMS
# Envoys each reporting BUCKETS buckets per message, the next as soon as the last is answered),
# with the server's CPU per check and per bucket report. With RLS the server works per
# request; with RLQS per bucket, Envoy and reporting interval, whatever the request rate.
# A third run has the Envoys report once, as if once a minute, on a limit whose capacity
# cannot pay for that (10 and 10/s), and counts the server's CPU per assignment it renews
# itself (`--rlqs-renew-every`, RENEW_EVERY, 250ms by default here).
set -euo pipefail
cd "$(dirname "$0")/.."
store=${1:-memory}
secs=${2:-10}
rounds=${3:-3}
streams=${4:-16}
buckets=${5:-100}
# shellcheck source=scripts/tollgate-bin.sh
source scripts/tollgate-bin.sh
cargo build --release -q -p tollgate-bench --bin rlqs-load
L=target/release/rlqs-load
work=$(mktemp -d)
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT

cat >"$work/policy.yaml" <<'YAML'
version: rlqs-cost
limits:
  - {name: per-tenant, domain: edge, key: [tenant], capacity: 1000000, refill: 100000/s}
  - {name: small, domain: renew, key: [tenant], capacity: 10, refill: 10/s}
YAML
store_flag=memory
if [[ $store == redis ]]; then
  # shellcheck source=scripts/scratch-redis.sh
  source scripts/scratch-redis.sh
  scratch_redis
  store_flag=$redis_url
fi
$B serve --http 127.0.0.1:0 --grpc 127.0.0.1:0 --store "$store_flag" --config "$work/policy.yaml" \
  --rlqs-renew-every "${RENEW_EVERY:-250ms}" >"$work/server.out" 2>&1 &
server=$!
pids+=($server)
until grep -q '^listening' "$work/server.out" 2>/dev/null; do sleep 0.1; done
grpc=$(sed -E 's/.*grpc=([^ ]+).*/\1/' <<<"$(grep '^listening' "$work/server.out")")

cpu() { awk '{print $14 + $15}' "/proc/$server/stat"; }
measure() {
  local name=$1; shift
  local before after out
  before=$(cpu)
  out=$("$@")
  after=$(cpu)
  python3 - "$name" "$before" "$after" "$out" <<'PY'
import json, os, sys
name, before, after, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
tick = os.sysconf("SC_CLK_TCK")
if "renewals" in out:
    units, rate, p50, p99 = out["renewals"], out["renewals_per_s"], float("nan"), float("nan")
    granted = f"{100 * out['tokens'] / max(out['tokens'] + out['blanket'], 1):.1f} % token buckets"
elif "bucket_reports" in out:
    units, rate, p50, p99 = out["bucket_reports"], out["bucket_reports_per_s"], out["p50_us"], out["p99_us"]
    granted = f"{100 * out['tokens'] / max(out['tokens'] + out['blanket'], 1):.1f} % token buckets"
else:
    units = out["allowed"] + out["rejected"] + out["errors"]
    rate, p50, p99 = out["decisions_per_s"], out["latency_us"]["p50"], out["latency_us"]["p99"]
    granted = f"{100 * out['allowed'] / max(units, 1):.1f} % allowed"
server_us = (after - before) / tick * 1e6 / max(units, 1)
print(f"| {name} | {rate:,.0f} | {p50/1000:.3f} | {p99/1000:.3f} | {server_us:.2f} | {granted} |")
PY
}
echo "| run ($store) | checks or bucket reports/s | p50 ms | p99 ms | server CPU µs each | answers |"
echo "|---|---|---|---|---|---|"
for round in $(seq "$rounds"); do
  measure "RLS check (round $round)" $B bench --grpc "$grpc" --domain edge --key-entry tenant \
    --keys 1600 -c 16 --connections 2 -d "${secs}s" --json
  measure "RLQS report, ${streams}×${buckets} buckets (round $round)" \
    $L "$grpc" edge "$streams" "$buckets" "$secs"
  measure "RLQS report, ${streams} Envoys × ${buckets} shared buckets (round $round)" \
    $L "$grpc" edge "$streams" "$buckets" "$secs" --shared
  measure "RLQS renewal, ${streams}×${buckets} buckets (round $round)" \
    $L "$grpc" renew "$streams" "$buckets" "$secs" --renewals
done
