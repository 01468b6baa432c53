#!/usr/bin/env bash
# Counts `tollgate bench`'s own instructions per request under callgrind: the load generator
# shares the cores with the server it measures, so what it spends per request moves the
# server's figures too. HTTP check, forward-auth and gRPC (a connection per worker), each as
# the difference between a run of 12,000 and one of 2,000 requests from 4 workers, divided by
# 10,000, so start-up and connecting cancel out. The server runs outside valgrind, on the
# memory store and the demo policy.
# Usage: scripts/generator-cost.sh   (TOLLGATE_BIN=path measures that build instead)
# Needs valgrind. Starts its own server on free loopback ports and stops it on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "valgrind is needed (apt-get install -y valgrind)" >&2; exit 1; }
# shellcheck source=scripts/tollgate-bin.sh
source scripts/tollgate-bin.sh
work=$(mktemp -d)
server=
cleanup() {
  [[ -n $server ]] && kill "$server" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

"$B" serve --http 127.0.0.1:0 --grpc 127.0.0.1:0 >"$work/server.out" 2>&1 &
server=$!
until grep -q '^listening' "$work/server.out" 2>/dev/null; do sleep 0.1; done
line=$(grep '^listening' "$work/server.out")
http=$(sed -E 's/.*http=([^ ]+).*/\1/' <<<"$line")
grpc=$(sed -E 's/.*grpc=([^ ]+).*/\1/' <<<"$line")

# Instructions of one generator run of $1 requests with the flags that follow.
count() {
  local n=$1; shift
  rm -f "$work"/cg.out*
  valgrind --tool=callgrind --callgrind-out-file="$work/cg.out" "$B" bench "$@" -c 4 -n "$n" >/dev/null 2>&1
  sed -n 's/^totals: *//p' "$work"/cg.out* | paste -sd+ | bc
}
echo "| generator | instructions per request |"
echo "|---|---|"
for kind in check forward-auth grpc; do
  case $kind in
    check) args=(--target "http://$http") ;;
    forward-auth) args=(--target "http://$http" --forward-auth) ;;
    grpc) args=(--grpc "$grpc") ;;
  esac
  short=$(count 2000 "${args[@]}")
  long=$(count 12000 "${args[@]}")
  echo "| $kind | $(((long - short) / 10000)) |"
done
