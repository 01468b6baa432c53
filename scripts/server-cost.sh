#!/usr/bin/env bash
# Counts `tollgate serve`'s instructions per request under callgrind, on the memory store: the
# no-op endpoint, the HTTP check, a forward-auth subrequest, the RLS gRPC call with a
# connection per worker and with the workers' calls multiplexed over one connection, and the
# HTTP check over HTTP/2 likewise. Unlike a rate, the count does not move
# with the host's load, so it compares builds (or the paths of one build) on a noisy host.
# Usage: scripts/server-cost.sh [rounds]   (TOLLGATE_BIN=path measures that build instead)
# Each figure is the instructions counted while `tollgate bench` (not under valgrind) sends N
# requests from 4 workers, divided by N; counting is on only then, after a warm-up.
# KEEP=dir keeps each run's callgrind file there, for callgrind_annotate. STORE=redis runs the
# server on a redis-server of its own instead of the memory store (the server's instructions
# only: Redis' are counted by scripts/redis-script-cost.sh). SERVE_ARGS adds flags to the
# server's (say "--trace-endpoint http://127.0.0.1:PORT", with target/release/otlp-sink on PORT:
# every thread of the server is counted, the one sending spans too). BENCH_ARGS adds flags to
# every `tollgate bench` (say "-H traceparent:00-<trace>-<span>-00", a caller's unsampled trace).
# Needs valgrind. Starts its own server (and redis-server) on free loopback ports and stops them on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}
n=${REQUESTS:-5000}
command -v valgrind >/dev/null || { echo "valgrind is needed (apt-get install -y valgrind)" >&2; exit 1; }
# shellcheck source=scripts/tollgate-bin.sh
source scripts/tollgate-bin.sh
work=$(mktemp -d)
server=
redis=
cleanup() {
  [[ -n $server ]] && kill "$server" 2>/dev/null
  [[ -n $redis ]] && kill "$redis" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

store=memory
if [[ ${STORE:-memory} == redis ]]; then
  rport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  redis-server --port "$rport" --bind 127.0.0.1 --save "" --appendonly no >"$work/redis.log" 2>&1 &
  redis=$!
  until redis-cli -p "$rport" ping >/dev/null 2>&1; do sleep 0.1; done
  store=redis://127.0.0.1:$rport
fi
read -ra extra <<<"${SERVE_ARGS:-}"
read -ra bench_extra <<<"${BENCH_ARGS:-}"
valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$work/cg.out" \
  "$B" serve --http 127.0.0.1:0 --grpc 127.0.0.1:0 --store "$store" "${extra[@]}" \
  >"$work/server.out" 2>"$work/server.err" &
server=$!
for _ in $(seq 1 120); do grep -q '^listening' "$work/server.out" 2>/dev/null && break; sleep 0.5; done
line=$(grep '^listening' "$work/server.out") || { cat "$work/server.err" >&2; exit 1; }
http=$(sed -n 's/.*http=\([^ ]*\).*/\1/p' <<<"$line")
grpc=$(sed -n 's/.*grpc=\([^ ]*\).*/\1/p' <<<"$line")

runs=("http /v1/noop" "http /v1/check" "fauth -" "grpc 4" "grpc 1" "http2 4" "http2 1")
send() { # kind arg count
  case $1 in
    http) "$B" bench --target "http://$http" --path "$2" -c 4 -n "$3" "${bench_extra[@]}" >/dev/null 2>&1 ;;
    fauth) "$B" bench --target "http://$http" --forward-auth -c 4 -n "$3" "${bench_extra[@]}" >/dev/null 2>&1 ;;
    grpc) "$B" bench --grpc "$grpc" --connections "$2" -c 4 -n "$3" "${bench_extra[@]}" >/dev/null 2>&1 ;;
    http2) "$B" bench --target "http://$http" --http2 --connections "$2" -c 4 -n "$3" "${bench_extra[@]}" >/dev/null 2>&1 ;;
  esac
}
for run in "${runs[@]}"; do send $run 1000; done # warm-up: connections, buckets, caches
echo "| round | no-op | HTTP check | forward-auth | gRPC, a connection per worker | gRPC, 4 workers over 1 connection | HTTP/2 check, a connection per worker | HTTP/2 check, 4 workers over 1 connection |"
echo "|---|---|---|---|---|---|---|---|"
for round in $(seq 1 "$rounds"); do
  row="| $round"
  for run in "${runs[@]}"; do
    rm -f "$work"/cg.out.*
    callgrind_control -z "$server" >/dev/null 2>&1
    callgrind_control -i on "$server" >/dev/null 2>&1
    send $run "$n"
    callgrind_control -i off "$server" >/dev/null 2>&1
    callgrind_control -d "$server" >/dev/null 2>&1
    for _ in $(seq 1 50); do compgen -G "$work/cg.out.*" >/dev/null && break; sleep 0.2; done
    total=$(sed -n 's/^totals: *//p' "$work"/cg.out.* | head -1)
    if [[ -n ${KEEP:-} ]]; then
      mkdir -p "$KEEP"
      name=${run// /}; cp "$work"/cg.out.* "$KEEP/round$round-${name//\//}.cg"
    fi
    row+=" | $((total / n))"
  done
  echo "$row |"
done
