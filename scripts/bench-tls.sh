#!/usr/bin/env bash
# Measures what TLS on the listeners costs: two `tollgate serve` processes on the memory store,
# one plain and one with --http-tls-* and --grpc-tls-* (a throwaway P-256 certificate and its authority,
# made with openssl), loaded in turn by `tollgate bench` (plain, then https://) so that a slow spell of
# the host hits both alike. Usage: scripts/bench-tls.sh [seconds] [rounds]
# (TOLLGATE_BIN=path runs that binary instead of building this checkout). Prints a row per run
# and, per kind of request, the TLS server's rate and CPU per request against the plain one's
# in each round. Starts its own servers on free loopback ports; kills them on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-5}
rounds=${2:-3}
# shellcheck source=scripts/tollgate-bin.sh
source scripts/tollgate-bin.sh
work=$(mktemp -d)
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT

# An authority and a server certificate it signs (rustls, in the generator, refuses an
# authority's own certificate as a server's, which a lone `openssl req -x509` would make).
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 \
  -subj /CN=tollgate-bench-ca -keyout "$work/ca.key" -out "$work/ca.pem" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=localhost \
  -keyout "$work/key.pem" -out "$work/server.csr" 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n' >"$work/ext"
openssl x509 -req -in "$work/server.csr" -CA "$work/ca.pem" -CAkey "$work/ca.key" \
  -CAcreateserial -days 1 -extfile "$work/ext" -out "$work/cert.pem" 2>/dev/null

start() { # name, serve flags...
  local name=$1; shift
  $B serve --http 127.0.0.1:0 --grpc 127.0.0.1:0 "$@" >"$work/$name.out" 2>&1 &
  pids+=($!)
  eval "${name}_pid=$!"
  until grep -q '^listening' "$work/$name.out" 2>/dev/null; do sleep 0.1; done
  local line
  line=$(grep '^listening' "$work/$name.out")
  eval "${name}_http=$(sed -E 's/.*http=([^ ]+).*/\1/' <<<"$line")"
  eval "${name}_grpc=$(sed -E 's/.*grpc=([^ ]+).*/\1/' <<<"$line")"
}
start plain
start tls --http-tls-cert "$work/cert.pem" --http-tls-key "$work/key.pem" \
  --grpc-tls-cert "$work/cert.pem" --grpc-tls-key "$work/key.pem"
# shellcheck disable=SC2154 # set by `start`
tls_args=(--tls-ca "$work/ca.pem")

# shellcheck source=scripts/bench-run.sh
source scripts/bench-run.sh
echo "| run | decisions/s | allowed | rejected | errors | p50 ms | p99 ms | p99.9 ms | sent late p99 ms | sent→answer p99 ms | server CPU µs/req | generator CPU µs/req | other CPU µs/req | stolen ms |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
# shellcheck disable=SC2154 # set by `start`
for round in $(seq "$rounds"); do
  server=$plain_pid run "plain HTTP check" --target "http://$plain_http" -c 16
  server=$tls_pid run "TLS HTTP check" --target "https://$tls_http" "${tls_args[@]}" -c 16
  server=$plain_pid run "plain gRPC" --grpc "$plain_grpc" -c 16
  server=$tls_pid run "TLS gRPC" --grpc "https://$tls_grpc" "${tls_args[@]}" -c 16
  server=$plain_pid run "plain gRPC mux" --grpc "$plain_grpc" -c 16 --connections 2
  server=$tls_pid run "TLS gRPC mux" --grpc "https://$tls_grpc" "${tls_args[@]}" -c 16 --connections 2
done
echo
python3 - "$work" <<'PY'
import json, statistics, sys
work = sys.argv[1]
def runs(name):
    with open(f"{work}/{name}.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]
for kind in ["HTTP_check", "gRPC", "gRPC_mux"]:
    plain, tls = runs(f"plain_{kind}"), runs(f"TLS_{kind}")
    ratios = [t["decisions_per_s"] / p["decisions_per_s"] for p, t in zip(plain, tls)]
    print(f"# {kind.replace('_', ' ')}: TLS / plain rate per round "
          f"{', '.join(f'{r:.0%}' for r in ratios)} (median {statistics.median(ratios):.0%})")
PY
