#!/usr/bin/env bash
# The GPU pass in parts that each fit one device call (under 9 minutes):
#
#   benchmarks/gpu/run.sh plan [BUDGET_S] # CPU: the one prepared command for the next lease
#   benchmarks/gpu/run.sh lease   # the ledger's due parts by priority within $LEASE_DEADLINE s
#   benchmarks/gpu/run.sh check   # versions, `gpu` tests, compile test, greedy checks, attention
#   benchmarks/gpu/run.sh bench   # bench.py 0.6B and 8B (async on/off), serving, profile
#   benchmarks/gpu/run.sh moe     # fused MoE kernel vs torch, Qwen3-30B-A3B experts, B 1/64/256;
#                                 # structured-output bitmask fill and apply, 1/64/256 rows
#   benchmarks/gpu/run.sh fp8     # 8B shape: bf16 vs FP8 weights, auto vs fp8 KV cache
#   benchmarks/gpu/run.sh spec    # speculative decoding (ngram, draft model) vs none, 0.6B shape
#   benchmarks/gpu/run.sh lora    # multi-LoRA: kernel and layer tests natively, the runner-level
#                                 # benchmark (0, 1, 4, 16 adapters; LOAD_LORA), 0.6B shape
#   benchmarks/gpu/run.sh pooling # embedding/reranker and YaRN tests natively, then
#                                 # benchmarks/embeddings.py on the 0.6B shape (sequences/s)
#   benchmarks/gpu/run.sh kvtier  # the multi-turn benchmark with and without the host and file
#                                 # KV tiers (a restart on the files), 0.6B shape
#   benchmarks/gpu/run.sh ttft    # where a served request's TTFT goes (1k prompts, 8 req/s)
#   benchmarks/gpu/run.sh sweeps  # the attention sweeps alone (without a GPU: a dry run whose
#                                 # tables go to $OUT/tables/ only, never into the tree)
#   benchmarks/gpu/run.sh PART... # any of the steps below by name, in the order given
#
# Plan, lease, ledger (issue 53; a lease is 15 minutes of device time in all, start included):
#   1. Here, on CPU: `benchmarks/gpu/run.sh plan` (default budget 480 s, about 8 minutes of the
#      lease; pass what is left, e.g. `plan 300`, for a second call). It reads
#      benchmarks/gpu/ledger.json (every part: class, estimated seconds, last run) and prints the
#      parts that fit, in order (by the ledger's priority classes: the `gpu` test groups, the
#      attention sweeps, the 0.6B workload, serving TTFT, spec, KV tiers, FP8, MoE, LoRA,
#      pooling, RL, 8B; within a class what never ran, failed or was cut off before what ran at
#      older code; parts already run at this code are skipped), the fetch-wheels.sh line with
#      the extra wheels they need, and the one device command with LEASE_COMMIT, LEASE_PARTS and
#      LEASE_DEADLINE. Commit first: the device's copy of .git is not to be trusted.
#   2. On the device: that command. `lease` copies the ledger to $OUT/ledger.json, marks each
#      part cut off when it starts and records its status (passed/failed/cut_off), rc, pytest
#      counts, figures and log paths when it ends, so a call killed at its limit still brings
#      back what finished, and an unfinished part never reads as passed.
#   3. Back here: commit $OUT/ledger.json as benchmarks/gpu/ledger.json with the results (their
#      logs are named benchmarks/results/<gpu>/<date>/STEP.log in it); the next plan continues
#      where this lease stopped. benchmarks/gpu/ledger.py holds the ordering; its tests are
#      tests/test_gpu_ledger.py (LEDGER=planted file, LEDGER_FAKE_PARTS=1: steps echo, and
#      LEDGER_FAKE="STEP:SLEEP_S:RC ..." plays a step's time and exit status).
#
# Everything goes under $OUT (default /tmp/gpu-out): one log per step, the result files, and
# results.tgz re-packed after every step so that a call killed at its limit still brings back
# what finished. Every step runs under its own timeout and a failing step does not stop the
# rest. Without a GPU it dry-runs the same steps on tiny shapes (the demo model, CPU); a dry
# run's ledger entries say `dry_run` and never count as a GPU run.
#
# The size presets (0.6B, 8B) carry Qwen3's tokenizer, built from the `dashscope` wheel's
# qwen.tiktoken (found, not imported: `../shared/device/fetch-wheels.sh dashscope` is enough), so
# that the serving benchmark's streams carry a chunk per token; bench_serving reports the chunks
# per output token and refuses TPOT/ITL when they are far below one.
set -uo pipefail
cd "$(dirname "$0")/../.."
LPY=${LPY:-python3}  # the ledger's interpreter: pure Python, any python3 >= 3.10
LEDGER_PY=benchmarks/gpu/ledger.py
if [ "${1:-}" = plan ]; then
  exec $LPY $LEDGER_PY plan --budget "${2:-480}"  # LEDGER=PATH: another ledger
fi

OUT=${OUT:-/tmp/gpu-out}
WORK=${WORK:-/tmp/gpu-work}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TP_ENGINE_CACHE=${TP_ENGINE_CACHE:-/tmp/tp-engine-cache}
unset TRITON_INTERPRET
PY=${PY:-python3}

FAKE=${LEDGER_FAKE_PARTS:-0}
if [ "$FAKE" = 1 ]; then
  GPU=0 PY=echo  # every step echoes; what parts compute outside steps is echoed too
  echo "fake parts: steps echo instead of running"
elif $PY -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  GPU=1
else
  GPU=0
  echo "no CUDA device: dry run on tiny shapes"
fi

SECONDS=0
pack() {
  tar czf "$OUT/results.tgz" -C "$WORK" --exclude='ckpt' --exclude='*.json.gz' . 2>/dev/null
  local f
  for f in "$WORK"/*/*.json.gz; do
    [ -f "$f" ] && cp "$f" "$OUT/$(basename "$(dirname "$f")")-$(basename "$f")"
  done
}

# A whole pass's deadline (seconds since start): a step gets at most what is left of it, and
# one with under $STEP_MIN_S (20) left is not started.
DEADLINE=${DEADLINE:-100000}
STEP_MIN_S=${STEP_MIN_S:-20}
STEPS_FILE=""  # set by lease: each step appends `NAME RC CUT` (CUT 1: the deadline stopped it)

# fake_params NAME: `SLEEP_S RC` of the stand-in for step NAME under LEDGER_FAKE_PARTS=1, as
# LEDGER_FAKE gives them ("NAME:SLEEP_S:RC ...", default 0 0).
fake_params() {
  local t sleep_s=0 rc=0
  for t in ${LEDGER_FAKE:-}; do
    if [ "${t%%:*}" = "$1" ]; then
      t=${t#*:}; sleep_s=${t%%:*}; rc=${t#*:}
    fi
  done
  echo "$sleep_s $rc"
}

# step NAME TIMEOUT_S CMD...: runs CMD with its output in $WORK/NAME.log (first line: the command).
step() {
  local name=$1 limit=$2 cut_by_deadline=0
  shift 2
  local left=$((DEADLINE - SECONDS))
  if [ $left -lt "$STEP_MIN_S" ]; then
    echo "[$(date +%T) +${SECONDS}s] $name: not started, ${left}s of the deadline left"
    [ -z "$STEPS_FILE" ] || echo "$name - 1" >>"$STEPS_FILE"  # no rc: it never ran
    return 0
  fi
  [ "$limit" -le "$left" ] || { limit=$left; cut_by_deadline=1; }
  echo "[$(date +%T) +${SECONDS}s] $name: $*"
  { echo "\$ $*"; echo; } >"$WORK/$name.log"
  if [ "$FAKE" = 1 ]; then
    local sleep_s fake_rc
    read -r sleep_s fake_rc <<<"$(fake_params "$name")"
    timeout -k 2 "$limit" bash -c "echo fake step $name: \$0; sleep $sleep_s; exit $fake_rc" "$*" \
      >>"$WORK/$name.log" 2>&1
  else
    timeout -k 15 "$limit" "$@" >>"$WORK/$name.log" 2>&1
  fi
  local rc=$?
  echo "rc=$rc" >>"$WORK/$name.log"
  echo "[$(date +%T) +${SECONDS}s] $name: rc=$rc"
  [ $rc -eq 0 ] || tail -n 25 "$WORK/$name.log" | sed 's/^/    /'
  # 124/137: timeout's TERM and KILL; a cut-off only when the deadline, not the step's own
  # limit, set the time (a step over its own limit failed).
  local cut=0
  [ $cut_by_deadline = 1 ] && { [ $rc = 124 ] || [ $rc = 137 ]; } && cut=1
  [ -z "$STEPS_FILE" ] || echo "$name $rc $cut" >>"$STEPS_FILE"
  pack
  return 0
}

# -- the steps ---------------------------------------------------------------------------------

env_info() {
  step env 60 env PY="$PY" bash -c '
    nvidia-smi || true
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.sm,power.limit --format=csv || true
    git log -1 --format="commit %H %s" || true
    "$PY" -c "
import platform, torch, triton, transformers
print(\"python\", platform.python_version(), \"torch\", torch.__version__, \"cuda\", torch.version.cuda,
      \"triton\", triton.__version__, \"transformers\", transformers.__version__)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(p.name, p.total_memory >> 20, \"MiB\", p.multi_processor_count, \"SMs\")
import zmq, fastapi, uvicorn, pydantic; print(\"zmq\", zmq.__version__, \"fastapi\", fastapi.__version__)
"'
}

gpu_tests() {
  # `gpu`-marked tests natively, then the sm_90 compile test (which is not marked).
  step pytest-gpu 420 $PY -m pytest -q -m gpu -p no:cacheprovider --durations=15 -rs tests
  step pytest-compile 180 $PY -m pytest -q -p no:cacheprovider tests/test_kernels_compile.py
}

greedy() {
  step greedy 300 $PY benchmarks/gpu/greedy_checks.py --out "$WORK/greedy"
  cp "$WORK/greedy/greedy_checks.json" "$WORK/" 2>/dev/null
  pack
}

attention() {
  step attention 240 $PY benchmarks/gpu/attention_micro.py --out "$WORK"
}

moe() {
  # The MoE kernel tests natively first (their GPU geometries are the 30B-A3B shapes), then the
  # microbenchmark (moe_micro.json).
  step pytest-moe 300 $PY -m pytest -q -p no:cacheprovider tests/test_kernels_moe.py
  step moe 300 $PY benchmarks/gpu/moe_micro.py --out "$WORK"
}

structured() {
  # Structured outputs: bitmask fill and apply at 1, 64, 256 constrained rows of a 151,936-token
  # vocabulary, logits on the GPU (the `gpu` tests include the kernel's check).
  local device=cpu
  [ $GPU = 1 ] && device=cuda
  step structured 240 $PY benchmarks/structured_outputs.py --device $device \
    --out "$WORK/structured_outputs.json"
}

# bench_one MODEL TAG ARGS...: launch/bench.py with its JSON, log and step timeline in $WORK.
bench_one() {
  local model=$1 tag=$2
  shift 2
  step "bench-$tag" 420 $PY launch/bench.py --model "$model" --max-model-len 4096 \
    --output-json "$WORK/bench-$tag.json" --step-timeline "$WORK/timeline-$tag.json" "$@"
}

bench_small() {
  if [ $GPU = 1 ]; then
    bench_one 0.6B 0.6B-tp1-async --async-scheduling
    bench_one 0.6B 0.6B-tp1-sync --no-async-scheduling
  else
    local tiny=(--num-seqs 8 --min-input-len 16 --max-input-len 64 --min-output-len 8
      --max-output-len 32 --num-kv-blocks 256)
    local demo
    demo=$($PY -c 'from benchmarks.models import resolve_model; print(resolve_model(None))')
    bench_one "$demo" demo-tp1-async "${tiny[@]}" --async-scheduling
    bench_one "$demo" demo-tp1-sync "${tiny[@]}" --no-async-scheduling
  fi
}

bench_8b() {
  if [ $GPU = 1 ]; then
    step ckpt-8B 300 $PY -c 'from benchmarks.models import resolve_model; print(resolve_model("8B"))'
    bench_one 8B 8B-tp1-async --async-scheduling
    bench_one 8B 8B-tp1-sync --no-async-scheduling
  else
    echo "8B: skipped without a GPU"
  fi
}

serving() {
  local model port=8123 extra=() n=200 rates=(8 32 inf) lens=(--random-input-len 1024
    --random-output-len 128 --random-range-ratio 0.5)
  if [ $GPU = 1 ]; then
    model=$($PY -c 'from benchmarks.models import resolve_model; print(resolve_model("0.6B"))')
    extra=(--max-model-len 4096)
  else
    model=$($PY -c 'from benchmarks.models import resolve_model; print(resolve_model(None))')
    extra=(--num-kv-blocks 512)
    n=16 rates=(8 inf) lens=(--random-input-len 64 --random-output-len 16 --random-vocab-size 600)
  fi
  echo "[$(date +%T) +${SECONDS}s] serve: $model"
  $PY launch/serve.py --model "$model" --port $port --disable-uvicorn-access-log "${extra[@]}" \
    >"$WORK/serving-server.log" 2>&1 &
  local server=$!
  local up=0
  for _ in $(seq 1 180); do
    if $PY -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
      "http://127.0.0.1:$port/health" >/dev/null 2>&1; then up=1; break; fi
    kill -0 $server 2>/dev/null || break
    sleep 1
  done
  if [ $up = 1 ]; then
    for rate in "${rates[@]}"; do
      step "serving-rate$rate" 180 $PY launch/bench_serving.py --base-url "http://127.0.0.1:$port" \
        --num-prompts $n --request-rate "$rate" "${lens[@]}" \
        --output-json "$WORK/serving-0.6B-tp1-rate$rate.json"
    done
  else
    echo "server did not come up:"; tail -n 30 "$WORK/serving-server.log"
    # For the ledger: a failed part, not one that had nothing to run.
    [ -z "$STEPS_FILE" ] || echo "serving-server 1 0" >>"$STEPS_FILE"
  fi
  kill -INT $server 2>/dev/null
  for _ in $(seq 1 30); do kill -0 $server 2>/dev/null || break; sleep 1; done
  kill -9 $server 2>/dev/null
  pack
}

profile() {
  if [ $GPU = 1 ]; then
    local n
    for n in 64 256; do
      step profile-async-$n 240 $PY benchmarks/gpu/profile_decode.py --model 0.6B --out "$WORK/profile-async-$n" --num-seqs $n --steps 20
    done
    step profile-eager-64 240 $PY benchmarks/gpu/profile_decode.py --model 0.6B --out "$WORK/profile-eager-64" --num-seqs 64 --steps 20 --enforce-eager
  else
    step profile-async 120 $PY benchmarks/gpu/profile_decode.py --out "$WORK/profile-async" --num-seqs 4 --steps 5
  fi
}

fp8() {
  # The 8B shape in bf16 and in Qwen's FP8 format (block-quantized from the same random
  # weights), each with the model-dtype and the fp8 KV cache (issue 27).
  local src fp8dir
  if [ $GPU = 1 ]; then
    src=$($PY -c 'from benchmarks.models import resolve_model; print(resolve_model("8B"))')
    fp8dir="$TP_ENGINE_CACHE/8B-fp8"
  else
    # FP8 packs q, k and v in whole 128-blocks: a tiny model with head_dim 128.
    src="$TP_ENGINE_CACHE/tiny-hd128"
    fp8dir="$TP_ENGINE_CACHE/tiny-hd128-fp8"
    [ -f "$src/config.json" ] || step ckpt-tiny 120 $PY -c '
import sys; from tp_engine.testing import build_random_qwen3
build_random_qwen3(sys.argv[1], hidden_size=256, num_layers=2, num_heads=2, num_kv_heads=1,
                   head_dim=128, intermediate_size=256, max_position_embeddings=4096)' "$src"
  fi
  [ -f "$fp8dir/config.json" ] || step ckpt-fp8 300 $PY -c \
    'import sys; from tp_engine.testing import quantize_checkpoint_fp8 as q; q(*sys.argv[1:])' \
    "$src" "$fp8dir"
  local extra=()
  [ $GPU = 1 ] || extra=(--num-seqs 8 --min-input-len 16 --max-input-len 64 --min-output-len 8
    --max-output-len 32 --num-kv-blocks 256)
  local w kv model
  for w in bf16 fp8; do
    for kv in auto fp8; do
      if [ $w = bf16 ]; then model=$src; else model=$fp8dir; fi
      bench_one "$model" "fp8-w$w-kv$kv" --kv-cache-dtype $kv "${extra[@]}"
    done
  done
}

spec() {
  # Issue 25's speculative.sh and issue 47's EAGLE-3 benchmark (lease_parts.sh).
  part_speculative
  part_eagle3
  pack
}

lora() {
  # Issue 38: the LoRA kernels and the mixed batch (eager and decode graphs) natively, then
  # benchmarks/lora_runner.py (tiny shapes without a GPU).
  step pytest-lora 300 $PY -m pytest -q -p no:cacheprovider -rs tests/test_kernels_lora.py \
    tests/test_lora_layers.py
  local shape=(--model 0.6B) tiny=()
  [ $GPU = 0 ] && tiny=(--layers 1 --batch 4 --prefill 32 --context 32 --repeats 2)
  step lora-runner 300 $PY -m benchmarks.lora_runner "${shape[@]}" "${tiny[@]}" \
    --out "$WORK/lora-runner.json"
}

pooling() {
  # Issue 37: the pooling heads and YaRN on the device (their tests pick it up), then
  # benchmarks/embeddings.py (the demo model without a GPU).
  step pytest-pooling 300 $PY -m pytest -q -p no:cacheprovider -rs tests/test_pooling.py \
    tests/test_yarn_e2e.py
  local model="" sizes=()
  if [ $GPU = 1 ]; then
    model=$($PY -c 'from benchmarks.models import resolve_model; print(resolve_model("0.6B"))')
    sizes=(--model "$model" --batch-sizes 1,16,64,256 --lengths 128,512,2048)
  else
    sizes=(--batch-sizes 1,8 --lengths 32 --repeats 1)
  fi
  step embeddings 300 $PY -m benchmarks.embeddings "${sizes[@]}" --out-dir "$WORK/embeddings"
}

tiles() {
  step decode-tiles 120 $PY benchmarks/gpu/decode_tiles.py --out "$WORK"
}

# kvtier: issue 46's KV tiers on benchmarks/multiturn.py (no tier, host, host + files, and a
# restart on the files), 0.6B on a GPU with histories far beyond a 256-block pool.
kvtier() {
  local sizes=()
  if [ $GPU = 1 ]; then
    sizes=(--model "$($PY -c 'from benchmarks.models import resolve_model; print(resolve_model("0.6B"))')"
      --conversations 32 --turns 6 --first-tokens 1024 --user-tokens 256 --output-tokens 64
      --num-kv-blocks 256 --max-model-len 4096 --offload-gib 4)
  else
    sizes=(--conversations 4 --turns 3)
  fi
  step multiturn 400 $PY -m benchmarks.multiturn "${sizes[@]}" --out-dir "$WORK/multiturn"
}

# ttft: issue 48's breakdown of a served request's time to first token (1k-token prompts at 8
# requests/s on the 0.6B shape, as the 2026-11-27 lease's serving run), stage by stage. Twice:
# as served by default, where a step carrying a 1k prompt (over the default largest mixed-step
# bucket, 512 tokens) runs eagerly; then with buckets up to 2048 tokens, where it replays a
# mixed-step graph (issue 57).
ttft() {
  local sizes=(--num-prompts 16 --input-len 64 --output-len 8)
  if [ $GPU = 1 ]; then
    sizes=(--model "$($PY -c 'from benchmarks.models import resolve_model; print(resolve_model("0.6B"))')"
      --rate 8 --num-prompts 200 --input-len 1024 --output-len 128)
  fi
  step ttft-breakdown 300 $PY -m benchmarks.ttft_breakdown "${sizes[@]}" \
    --output-json "$WORK/ttft-breakdown.json"
  step ttft-breakdown-graphs 300 $PY -m benchmarks.ttft_breakdown "${sizes[@]}" \
    --label graphs2048 --output-json "$WORK/ttft-breakdown-graphs.json" \
    -- --cuda-graph-max-tokens 2048
}

# sweeps: issue 48's tables, measured here and then used by everything timed after them. The
# decode sweep (split and packed kernels, their tiles; 1/8/64/256 sequences x 1k/4k/16k, bf16 and
# fp8 KV) within $SWEEP_BUDGET s, then attention_micro (--quick: 2 decode, 2 prefill shapes),
# whose prefill candidates choose between the paged and the TMA kernel per prompt length. Each
# writes its table into kernels/tuned/ of the tree this runs from (the runtime reads it there),
# copied to $OUT/tables/ to come back and be committed. A sweep that fails or is cut off writes
# no table, and the tree's committed one stays. Without a GPU the tables (dry-run figures,
# capability [0, 0]) go to $OUT/tables/ only.
sweeps() {
  part_decode_sweep
  part_attention_micro
  echo "[$(date +%T) +${SECONDS}s] tables: $(ls "$OUT/tables" | tr '\n' ' ')"
  pack
}

sweep_tables() {  # where the sweeps write their tables: the tree's on a GPU, $WORK's without
  if [ $GPU = 1 ]; then echo kernels/tuned; else echo "$WORK/tables"; fi
}

keep_table() {  # keep_table FILE: the table comes back in $OUT/tables/ (and in results.tgz)
  local tables
  tables=$(sweep_tables)
  mkdir -p "$OUT/tables" "$WORK/tables"
  [ -f "$tables/$1" ] || return 0
  cp "$tables/$1" "$OUT/tables/$1"
  [ "$tables" = "$WORK/tables" ] || cp "$tables/$1" "$WORK/tables/$1"
}

part_decode_sweep() {
  local tables budget=${SWEEP_BUDGET:-150}
  tables=$(sweep_tables)
  mkdir -p "$tables"
  step decode-tiles $((budget + 60)) $PY benchmarks/gpu/decode_tiles.py --out "$WORK" \
    --table "$tables/decode_tiles.json" --budget-s "$budget"
  keep_table decode_tiles.json
}

part_attention_micro() {
  local tables
  tables=$(sweep_tables)
  mkdir -p "$tables"
  step attention 240 $PY benchmarks/gpu/attention_micro.py --out "$WORK" --quick \
    --prefill-table "$tables/prefill_tiles.json"
  keep_table prefill_tiles.json
}

# The ledger's parts (gpu_group, part_*) and `lease`.
source benchmarks/gpu/lease_parts.sh

# -- parts -------------------------------------------------------------------------------------

[ $# -gt 0 ] || set -- check
for part in "$@"; do
  case $part in
    check) env_info; gpu_tests; greedy; attention ;;
    bench) env_info; bench_small; serving; profile; bench_8b ;;
    moe) env_info; moe; structured ;;
    fp8) env_info; fp8 ;;
    spec) env_info; spec ;;
    lora) env_info; lora ;;
    pooling) env_info; pooling ;;
    lease) lease ;;
    sweeps) env_info; sweeps ;;
    kvtier) env_info; kvtier ;;
    ttft) env_info; ttft ;;
    env_info|tiles|gpu_tests|greedy|attention|bench_small|bench_8b|serving|profile|structured|fp8) $part ;;
    part_*) $part ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
pack
echo "[$(date +%T) +${SECONDS}s] done; $OUT:"; ls -la "$OUT"
