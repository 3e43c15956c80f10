#!/usr/bin/env bash
# Serving benchmark through sglang-router at 1 and 2 replicas of the demo model, on CPU.
#
#   bash benchmarks/data_parallel.sh [OUT_DIR]    (default benchmarks/results/cpu/data-parallel)
#
# For each replica count N: `launch/serve.py --data-parallel-size N` (the router in front, on a
# free port), then `launch/bench_serving.py` against the router with text prompts (the router
# refuses token-id prompts), then SIGTERM. Writes serving-dpN.json, the launcher's and the
# client's raw logs, and COMMANDS (every command as run). Extra arguments for the launcher go in
# $SERVE_ARGS, for the client in $BENCH_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/cpu/data-parallel}
PY=${PYTHON:-python}
mkdir -p "$OUT"
: > "$OUT/COMMANDS"

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

for N in 1 2; do
    PORT=$(free_port)
    METRICS_PORT=$(free_port)
    SERVE=("$PY" launch/serve.py --data-parallel-size "$N" --port "$PORT"
           --router-prometheus-port "$METRICS_PORT" --max-model-len 1024
           --disable-uvicorn-access-log ${SERVE_ARGS:-})
    BENCH=("$PY" launch/bench_serving.py --base-url "http://127.0.0.1:$PORT"
           --dataset-name random --random-as-text --random-input-len 48
           --random-output-len 64 --random-vocab-size 2000 --num-prompts 256
           --max-concurrency 16 --label "data-parallel $N, CPU"
           --output-json "$OUT/serving-dp$N.json" ${BENCH_ARGS:-})
    { printf '%q ' "${SERVE[@]}"; echo; printf '%q ' "${BENCH[@]}"; echo; } >> "$OUT/COMMANDS"
    "${SERVE[@]}" > "$OUT/serve-dp$N.log" 2>&1 &
    SERVER=$!
    # Whatever fails below, the server does not outlive the script.
    trap 'kill -TERM "$SERVER" 2> /dev/null; wait "$SERVER"' EXIT
    for _ in $(seq 1 600); do
        grep -q "router (.*) serving" "$OUT/serve-dp$N.log" && break
        kill -0 "$SERVER" 2> /dev/null || { tail -50 "$OUT/serve-dp$N.log"; exit 1; }
        sleep 0.5
    done
    "${BENCH[@]}" 2>&1 | tee "$OUT/bench-dp$N.log"
    # The router's own count of requests per replica, for the record.
    curl -s "http://127.0.0.1:$METRICS_PORT/metrics" | grep '^smg_worker_cb_outcomes_total' \
        > "$OUT/router-metrics-dp$N.txt" || true
    kill -TERM "$SERVER"
    wait "$SERVER"
    trap - EXIT
done
