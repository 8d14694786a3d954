#!/usr/bin/env bash
# Load numbers for `byblock serve` (RESULTS.md §serve): start a server on a free loopback port, run
# `byblock loadgen` at 1, 4 and 16 clients for each drafter, stop the server.
#   benchmarks/serve_load.sh SECTION [serve flags...]   e.g.  benchmarks/serve_load.sh serve-fp32 --dtype float32
set -euo pipefail
cd "$(dirname "$0")/.."
SECTION=${1:?section name}; shift
BYBLOCK=${BYBLOCK:-.venv/bin/byblock}
PORT=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
DRAFTERS=${DRAFTERS:-none,dflash,ngram}
IFS=, read -ra DLIST <<< "$DRAFTERS"
SERVE_ARGS=()
for d in "${DLIST[@]}"; do [ "$d" = none ] || SERVE_ARGS+=(--drafter "$d"); done
$BYBLOCK serve --port "$PORT" "${SERVE_ARGS[@]}" "$@" --log-level warning &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 300); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.5; done
$BYBLOCK loadgen --url "http://127.0.0.1:$PORT" --drafters "$DRAFTERS" --concurrency "${CONCURRENCY:-1,4,16}" \
    --requests "${REQUESTS:-16}" --max-tokens "${MAX_TOKENS:-64}" --out "bench-out/$SECTION" \
    --update-results benchmarks/RESULTS.md --section "$SECTION"
