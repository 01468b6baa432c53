#!/usr/bin/env bash
# Measures `tollgate serve` with `tollgate bench`, every run against one server process, as
# BENCHMARKS.md reports it. Usage: scripts/bench-server.sh [memory|redis] [seconds] [rounds]
# (SERVE_ARGS="--runtime per-core" adds flags to `tollgate serve`; TOLLGATE_BIN=path runs that
# binary instead of building this checkout).
# Starts its own server (and redis-server for `redis`) on free loopback ports; kills them on exit.
# The closed-loop runs repeat `rounds` times, interleaved (no-op, check, gRPC, no-op, ...), so a
# slow spell of the host hits every kind of run alike; the ratios are taken within each round and
# their medians printed at the end. The open-loop runs follow, at half and a quarter of the
# median check rate. Open-loop rows also give how late the generator sent (p99): that lateness is
# part of the latency, and when it is most of it the generator, not the server, fell behind;
# and the p99 counted from each send instead of its schedule (the latency without the lateness).
set -euo pipefail
cd "$(dirname "$0")/.."
store=${1:-memory}
secs=${2:-10}
rounds=${3:-1}
# shellcheck source=scripts/tollgate-bin.sh
source scripts/tollgate-bin.sh
work=$(mktemp -d)
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT

store_flag=memory
if [[ $store == redis ]]; then
  # shellcheck source=scripts/scratch-redis.sh
  source scripts/scratch-redis.sh
  scratch_redis
  store_flag=$redis_url
fi
# shellcheck disable=SC2086 # SERVE_ARGS is a list of flags
$B serve --http 127.0.0.1:0 --grpc 127.0.0.1:0 --store "$store_flag" ${SERVE_ARGS:-} >"$work/server.out" 2>&1 &
server=$!
pids+=($server)
until grep -q '^listening' "$work/server.out" 2>/dev/null; do sleep 0.1; done
line=$(grep '^listening' "$work/server.out")
http=$(sed -E 's/.*http=([^ ]+).*/\1/' <<<"$line")
grpc=$(sed -E 's/.*grpc=([^ ]+).*/\1/' <<<"$line")

# shellcheck source=scripts/bench-run.sh
source scripts/bench-run.sh
echo "| run ($store) | decisions/s | allowed | rejected | errors | p50 ms | p99 ms | p99.9 ms | sent late p99 ms | sent→answer p99 ms | server CPU µs/req | generator CPU µs/req | other CPU µs/req | stolen ms |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
for round in $(seq "$rounds"); do
  run "HTTP /v1/noop" --target "http://$http" --path /v1/noop -c 16
  run "HTTP /v1/check" --target "http://$http" -c 16
  run "HTTP forward-auth" --target "http://$http" --forward-auth -c 16
  run "gRPC RLS" --grpc "$grpc" -c 16
  run "gRPC RLS, 16 streams over 2 connections" --grpc "$grpc" -c 16 --connections 2
  run "HTTP/2 /v1/check, 16 streams over 2 connections" --target "http://$http" --http2 -c 16 --connections 2
done
# Medians of the rates and of the ratios within each round.
python3 - "$work" <<'PY' >"$work/summary"
import json, statistics, sys
work = sys.argv[1]
def rates(name):
    with open(f"{work}/{name}.jsonl") as f:
        return [json.loads(line)["decisions_per_s"] for line in f if line.strip()]
noop, check = rates("HTTP__v1_noop"), rates("HTTP__v1_check")
grpc, mux = rates("gRPC_RLS"), rates("gRPC_RLS__16_streams_over_2_connections")
forward = rates("HTTP_forward_auth")
h2 = rates("HTTP_2__v1_check__16_streams_over_2_connections")
med = statistics.median
def ratios(a, b):
    return ", ".join(f"{x / y:.0%}" for x, y in zip(a, b))
print(f"half={int(med(check) / 2)}")
print(f"# medians over {len(check)} rounds: no-op {med(noop):,.0f}/s, check {med(check):,.0f}/s, "
      f"forward-auth {med(forward):,.0f}/s, gRPC {med(grpc):,.0f}/s, gRPC over 2 connections {med(mux):,.0f}/s, "
      f"HTTP/2 check over 2 connections {med(h2):,.0f}/s")
print(f"# check / no-op per round: {ratios(check, noop)} (median {med([c / n for c, n in zip(check, noop)]):.0%})")
print(f"# forward-auth / no-op per round: {ratios(forward, noop)} "
      f"(median {med([f / n for f, n in zip(forward, noop)]):.0%})")
print(f"# gRPC / check per round: {ratios(grpc, check)} (median {med([g / c for g, c in zip(grpc, check)]):.0%})")
print(f"# gRPC over 2 connections / check per round: {ratios(mux, check)} "
      f"(median {med([m / c for m, c in zip(mux, check)]):.0%})")
print(f"# HTTP/2 check over 2 connections / check per round: {ratios(h2, check)} "
      f"(median {med([h / c for h, c in zip(h2, check)]):.0%})")
PY
half=$(sed -n 's/^half=//p' "$work/summary")
quarter=$((half / 2))
run "HTTP /v1/check, open loop at $half/s (half of peak)" --target "http://$http" -c 32 --rate "$half"
run "HTTP /v1/check, open loop at $quarter/s (quarter of peak)" --target "http://$http" -c 32 --rate "$quarter"
echo
grep '^#' "$work/summary"
