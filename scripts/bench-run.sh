# Sourced by the server measurement scripts: `run NAME BENCH-ARGS...` runs `tollgate bench`
# ($B) for $secs seconds against the server whose process id is $server, prints one table row
# (rates, latency, the server's, the generator's and other CPU per request, time stolen by the
# hypervisor) and appends the run's JSON to $work/NAME.jsonl (NAME with every character but
# letters and digits as _), for the script's medians.
# shellcheck shell=bash
# CPU ticks: the server's (utime + stime) and the whole machine's busy time.
cpu() { awk '{print $14 + $15}' "/proc/$server/stat"; }
busy() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8}' /proc/stat; }
# Time the hypervisor ran something else on our virtual CPUs: a stall the server cannot help.
steal() { awk '/^cpu /{print $9}' /proc/stat; }
run() {
  local name=$1; shift
  local before busy_before after busy_after out
  before=$(cpu)
  busy_before=$(busy)
  steal_before=$(steal)
  out=$(/usr/bin/time -f '%U %S' -o "$work/time" $B bench "$@" -d "${secs}s" --json 2>/dev/null)
  after=$(cpu)
  busy_after=$(busy)
  steal_after=$(steal)
  echo "$out" >"$work/last.json"
  echo "$out" >>"$work/$(tr -c 'a-zA-Z0-9\n' _ <<<"$name").jsonl"
  python3 - "$name" "$before" "$after" "$busy_before" "$busy_after" "$((steal_after - steal_before))" "$(cat "$work/time")" "$out" <<'PY'
import json, os, sys
name = sys.argv[1]
before, after, busy_before, busy_after, stolen = map(int, sys.argv[2:7])
gen = sum(map(float, sys.argv[7].split()))
out = json.loads(sys.argv[8])
total = max(out["allowed"] + out["rejected"] + out["errors"], 1)
tick = os.sysconf("SC_CLK_TCK")
server_us = (after - before) / tick * 1e6 / total
gen_us = gen * 1e6 / total
other_us = (busy_after - busy_before) / tick * 1e6 / total - server_us - gen_us
l = out["latency_us"]
lag = out.get("schedule_lag_us")
late = f"{lag['p99']/1000:.3f}" if lag else "–"
service = out.get("service_us")
served = f"{service['p99']/1000:.3f}" if service else "–"
print(f"| {name} | {out['decisions_per_s']:,.0f} | {out['allowed']:,} | {out['rejected']:,} | {out['errors']} "
      f"| {l['p50']/1000:.3f} | {l['p99']/1000:.3f} | {l['p99_9']/1000:.3f} | {late} | {served} "
      f"| {server_us:.1f} | {gen_us:.1f} | {other_us:.1f} | {stolen * 1000 // tick} |")
PY
}
