# Sourced by the server measurement scripts, from the project root: sets B to the tollgate
# binary to measure, TOLLGATE_BIN when given (another build, measured as it is, server and
# load generator alike), else this checkout's release build, built first.
# shellcheck shell=bash
if [[ -n ${TOLLGATE_BIN:-} ]]; then
  B=$TOLLGATE_BIN
else
  cargo build --release -q -p tollgate-server
  B=target/release/tollgate
fi
