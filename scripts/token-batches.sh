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
# shellcheck source=scripts/redis-flag-ab.sh
source scripts/redis-flag-ab.sh
cat >"$work/policy.yaml" <<'YAML'
version: "busy"
limits:
  - name: per-user
    domain: api
    key: [user]
    capacity: 1000000
    refill: 1000000/m
YAML

ab_header batch
for _ in $(seq "$rounds"); do
  for tokens in "$batch" 0; do
    label=$([[ $tokens != 0 ]] && echo "$tokens" || echo off)
    ab_run "$label" 1 uniform --token-batch "$tokens"
    ab_run "$label" 10000 zipf --token-batch "$tokens"
  done
done
