#!/usr/bin/env bash
# Counts redis-server's instructions per decision of crates/tollgate-redis/scripts/take.lua,
# under callgrind: unlike Redis' own `usec` figures, the count does not move with the host's
# load, so two versions of the script can be compared on a busy machine. Usage:
#   scripts/redis-script-cost.sh [decisions-per-call ...]      (default: 1 8 32)
# Each call takes one token from each of its decisions' buckets (distinct keys, Redis `TIME`),
# as `RedisStore` sends it; HOT=1 puts every decision of a call on one key (one hot key's
# concurrent callers sharing calls). The buckets are those of `redis-load` (10^9 tokens, as many
# a second): full again a nanosecond after a take, so each key lives the shortest TTL, 1 ms.
# LIVE=1 takes a second's worth of refill instead, so the keys stay and every write replaces a
# live bucket and its TTL. BUCKETS=2 makes each decision a request over two buckets (two limits
# applying to it), counted once. TAKE_LUA=path measures another version of the script;
# LAYOUT=old sends the arguments as scripts before the layout flag (ARGV[4]) read them, and
# LAYOUT=1 sends takes of one bucket on distinct keys as scripts before the straight loop
# did (the general path of today's script, which its calls with a repeated key take). Needs
# valgrind and python3; starts its own redis-server on a free loopback port and kills it on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
(($# > 0)) || set -- 1 8 32
sizes=("$@")
work=$(mktemp -d)
pid=
cleanup() { [[ -n $pid ]] && kill "$pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
command -v valgrind >/dev/null || { echo "valgrind is needed (apt-get install -y valgrind)" >&2; exit 1; }

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
valgrind --tool=callgrind --callgrind-out-file="$work/cg.out" \
  redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no >"$work/redis.log" 2>&1 &
pid=$!
until redis-cli -p "$port" ping >/dev/null 2>&1; do sleep 0.2; done

# Sends `calls` EVALSHA calls of `m` decisions each, four in flight, in the argument layout of
# take.lua (bucket figures as three little-endian doubles).
drive() {
  python3 - "$port" "${TAKE_LUA:-crates/tollgate-redis/scripts/take.lua}" "$1" "$2" "${HOT:-}" "${LAYOUT:-}" "${LIVE:-}" "${BUCKETS:-1}" <<'EOF'
import hashlib, socket, struct, sys
port, path, m, calls = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
hot, layout, live = sys.argv[5] == '1', sys.argv[6], sys.argv[7] == '1'
old = layout == 'old'
b = int(sys.argv[8])
if hot and b > 1:
    sys.exit('HOT=1 puts one bucket in each request: not with BUCKETS')
source = open(path, 'rb').read()
def resp(args):
    out = [b'*%d\r\n' % len(args)]
    for arg in args:
        arg = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b'$%d\r\n%s\r\n' % (len(arg), arg))
    return b''.join(out)
conn = socket.create_connection(('127.0.0.1', port))
replies = conn.makefile('rb')
def read():
    line = replies.readline()
    if line[:1] == b'-':
        sys.exit('redis error: %s' % line.decode().strip())
    if line[:1] == b'$' and int(line[1:]) >= 0:
        replies.read(int(line[1:]) + 2)
    if line[:1] == b'*':
        for _ in range(int(line[1:])):
            read()
conn.sendall(resp(['SCRIPT', 'LOAD', source])); read()
keys = ['k0'] * m if hot else ['k%d' % i for i in range(m * b)]
# The third argument says whether a key repeats in the call, as the store's client works it out.
args = ['EVALSHA', hashlib.sha1(source).hexdigest(), len(keys)] + keys + ['', m, '1' if hot and m > 1 else '']
# Every request is a take without an id: the fourth argument says so, and each request sends
# its figures alone (one bucket) or its number of buckets and then their figures. Takes of one
# bucket on distinct keys go to the script's straight loop ("s"), as the store sends them,
# unless LAYOUT=1 sends them to its general path ("1", as a call with a repeated key goes).
args += [] if old else ['n' if b > 1 else '1' if hot or layout == '1' else 's']
for _ in range(m):
    # 10^9 tokens, refilled 10^9 per second: a = 1000 units per microsecond, one unit per token.
    # LIVE: 10^15 tokens at the same rate, each take 10^9 of them, a second's refill: no
    # bucket is full again for as many seconds as it has had takes, and its key stays.
    figures = (1000, 1e15, 1e9) if live else (1000, 1e9, 1)
    head = [b, '', '', 'take'] if old else ([] if b == 1 else [b])
    args += head + [struct.pack('<ddd', *figures)] * b
call = resp(args)
for _ in range(calls // 4):
    conn.sendall(call * 4)
    for _ in range(4):
        read()
EOF
}

echo "| decisions per call | redis-server instructions per decision |"
echo "|---|---|"
for m in "${sizes[@]}"; do
  calls=$((32000 / m)); ((calls > 4000)) && calls=4000
  redis-cli -p "$port" flushall >/dev/null
  drive "$m" 100
  callgrind_control -z "$pid" >/dev/null
  drive "$m" "$calls"
  rm -f "$work"/cg.out.*
  callgrind_control -d "$pid" >/dev/null
  total=$(callgrind_annotate "$work"/cg.out.* 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
  echo "| $m | $((total / calls / m)) |"
done
