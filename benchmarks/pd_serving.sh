#!/usr/bin/env bash
# TTFT and TPOT of one server against a prefill/decode pair behind sglang-router, on this
# machine, with launch/bench_serving.py (benchmarks/results/cpu/pd-serving/README.md).
#
#   bash benchmarks/pd_serving.sh [OUT_DIR]     (from the repository root, the venv active)
#
# Both setups serve the demo model at TP 1 with the same flags; the pair runs docs/
# disaggregation.md's commands. Every server is stopped at the end.
set -euo pipefail
out=${1:-benchmarks/results/cpu/pd-serving}
mkdir -p "$out"
py=${PYTHON:-python}
bench=(--model tp-engine-demo --dataset-name random --random-as-text --random-input-len 128
       --random-output-len 32 --random-vocab-size 600 --num-prompts 32 --request-rate 1 --seed 0)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
wait_http() { for _ in $(seq 600); do curl -sf "$1" >/dev/null && return 0; sleep 0.2; done; return 1; }
common=(--num-kv-blocks 512 --disable-uvicorn-access-log)

$py launch/serve.py --port 31000 "${common[@]}" >"$out/single-server.log" 2>&1 & pids+=($!)
wait_http http://127.0.0.1:31000/health
$py launch/bench_serving.py --base-url http://127.0.0.1:31000 "${bench[@]}" --label single \
    --output-json "$out/single.json" | tee "$out/single-bench.log"
cleanup; pids=()

$py launch/serve.py --disaggregation-mode prefill --port 30000 --disaggregation-bootstrap-port 8998 \
    "${common[@]}" >"$out/prefill.log" 2>&1 & pids+=($!)
$py launch/serve.py --disaggregation-mode decode --port 30001 "${common[@]}" >"$out/decode.log" 2>&1 & pids+=($!)
wait_http http://127.0.0.1:30000/health && wait_http http://127.0.0.1:30001/health
$py -m sglang_router.launch_router --pd-disaggregation --prefill http://127.0.0.1:30000 8998 \
    --decode http://127.0.0.1:30001 --host 127.0.0.1 --port 8000 --prometheus-port 31090 \
    --log-level warn >"$out/router.log" 2>&1 & pids+=($!)
for _ in $(seq 300); do
    curl -sf http://127.0.0.1:8000/generate -H 'Content-Type: application/json' \
        -d '{"text": "hi", "sampling_params": {"max_new_tokens": 1}}' >/dev/null && break
    sleep 0.2
done
$py launch/bench_serving.py --base-url http://127.0.0.1:8000 "${bench[@]}" --label pd-router \
    --output-json "$out/pd-router.json" | tee "$out/pd-router-bench.log"
curl -s http://127.0.0.1:30001/metrics | grep -E '^(tp_engine:prompt_tokens_computed|vllm:external_prefix_cache_hits)' \
    >"$out/decode-metrics.txt"
curl -s http://127.0.0.1:30000/metrics | grep -E '^tp_engine:prompt_tokens_computed' >"$out/prefill-metrics.txt"
