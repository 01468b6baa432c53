# Sourced by the scripts that measure one `tollgate serve` flag on and off against a Redis of
# their own (rejection-memory.sh, token-batches.sh), from the project root after
# tollgate-bin.sh: starts a throwaway redis-server on a free loopback port (killed on exit,
# with every server started here) and gives `ab_header` and `ab_run`, so both measure alike.
# Expects `secs` (seconds per run); the caller writes its policy to "$work/policy.yaml".
# shellcheck shell=bash
work=$(mktemp -d)
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT

# shellcheck source=scripts/scratch-redis.sh
source scripts/scratch-redis.sh
scratch_redis

redis_info() { redis-cli -p "$rport" INFO "$1" | tr -d '\r'; }

# ab_header NAME: the table's header, NAME heading the column of the flag's setting.
ab_header() {
  printf '%-6s %-12s %9s %9s %12s %14s %8s\n' "$1" keys checks/s rejected calls/check \
    "redis CPU µs" "p99 ms"
}

# ab_run LABEL COUNT DISTRIBUTION [SERVE FLAGS...]: one server with the flags on an emptied
# Redis, `tollgate bench` over HTTP at 16 workers for $secs on COUNT keys drawn DISTRIBUTION;
# prints a row: checks/s, the share rejected, script calls per check (INFO commandstats),
# Redis' CPU per check and the p99 latency.
ab_run() {
  local label=$1 count=$2 distribution=$3
  shift 3
  redis-cli -p "$rport" FLUSHALL >/dev/null
  redis-cli -p "$rport" CONFIG RESETSTAT >/dev/null
  $B serve --config "$work/policy.yaml" --store "$redis_url" \
    --http 127.0.0.1:0 --grpc 127.0.0.1:0 "$@" >"$work/server.out" 2>&1 &
  local server=$!
  pids+=("$server")
  until grep -q '^listening' "$work/server.out" 2>/dev/null; do sleep 0.1; done
  local http cpu_before cpu_after out calls
  http=$(sed -E 's/.*http=([^ ]+).*/\1/' <<<"$(grep '^listening' "$work/server.out")")
  cpu_before=$(redis_info cpu | awk -F: '/used_cpu_(sys|user):/{s+=$2} END{print s}')
  out=$($B bench --target "http://$http" --keys "$count" --distribution "$distribution" \
    -c 16 -d "${secs}s" --json 2>/dev/null)
  cpu_after=$(redis_info cpu | awk -F: '/used_cpu_(sys|user):/{s+=$2} END{print s}')
  calls=$(redis_info commandstats | awk -F'[=,:]' '/^cmdstat_eval(sha)?:/{s+=$3} END{print s+0}')
  kill "$server"
  wait "$server" 2>/dev/null || true
  python3 - "$label" "$count $distribution" "$calls" "$cpu_before" "$cpu_after" "$out" <<'PY'
import json, sys
label, keys, calls, before, after, out = sys.argv[1:]
r = json.loads(out)
checks = r["allowed"] + r["rejected"]
print(f'{label:<6} {keys:<12} {r["decisions_per_s"]:>9.0f} '
      f'{r["rejected"] / max(checks, 1):>9.3f} {float(calls) / max(checks, 1):>12.4f} '
      f'{(float(after) - float(before)) * 1e6 / max(checks, 1):>14.2f} '
      f'{r["latency_us"]["p99"] / 1000:>8.3f}')
PY
}
