# Sourced by the measurement scripts, from the project root, after `work` (a scratch directory)
# and `pids` (the processes to kill on exit) are set: `scratch_redis` starts a redis-server of
# the script's own on a free loopback port, without persistence, waits until it answers, and
# sets `rport` to its port and `redis_url` to its URL.
# shellcheck shell=bash
scratch_redis() {
  rport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  redis-server --port "$rport" --bind 127.0.0.1 --save "" --appendonly no >"$work/redis.log" 2>&1 &
  pids+=($!)
  until redis-cli -p "$rport" ping >/dev/null 2>&1; do sleep 0.1; done
  redis_url=redis://127.0.0.1:$rport
}
