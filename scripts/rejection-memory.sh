#!/usr/bin/env bash
# Measures what the memory of rejections (`--rejection-memory`) spares Redis, as BENCHMARKS.md
# reports it. Usage: scripts/rejection-memory.sh [seconds] [rounds]
# One redis-server and one `tollgate serve` at a time, on free loopback ports, killed on exit.
# A policy of 10 a minute per user; `tollgate bench` over HTTP at 16 workers hammers one key, then
# 10,000 keys drawn Zipf (a few hot keys far past the limit, a long tail under it). Each round
# runs the server with the memory on and off, alternated, each on an emptied Redis; per run:
# checks/s, the share rejected, script calls per check (INFO commandstats) and Redis' CPU per
# check.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
rounds=${2:-3}
# shellcheck source=scripts/tollgate-bin.sh
source scripts/tollgate-bin.sh
# shellcheck source=scripts/redis-flag-ab.sh
source scripts/redis-flag-ab.sh
cat >"$work/policy.yaml" <<'EOF'
version: "hammered"
limits:
  - name: per-user
    domain: api
    key: [user]
    capacity: 10
    refill: 10/m
EOF

ab_header memory
for _ in $(seq "$rounds"); do
  for memory in 100000 0; do
    label=$([[ $memory != 0 ]] && echo on || echo off)
    ab_run "$label" 1 uniform --rejection-memory "$memory"
    ab_run "$label" 10000 zipf --rejection-memory "$memory"
  done
done
