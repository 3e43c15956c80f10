# shellcheck shell=bash
# The ledger's parts and the lease that runs them (issue 53), sourced by benchmarks/gpu/run.sh:
# they use its step(), pack(), $PY, $GPU, $WORK and $OUT. benchmarks/gpu/ledger.json names each
# part's function; benchmarks/gpu/ledger.py orders the parts and records their results.

# -- the ledger's parts (benchmarks/gpu/ledger.json names them; `lease` calls each with the
# part's name and estimated seconds) ------------------------------------------------------------

# gpu_group NAME EST_S: a test group of the ledger (its files that exist, its marker, xdist
# workers where the ledger asks and pytest-xdist is installed), one pytest process, under twice
# its estimate.
gpu_group() {
  local word args=() xdist=()
  $PY -c 'import xdist' >/dev/null 2>&1 && xdist=(-n 6)
  for word in $($LPY $LEDGER_PY pytest-args --ledger "$LEASE_LEDGER" --part "$1"); do
    if [ "$word" = @xdist ]; then args+=("${xdist[@]}"); else args+=("$word"); fi
  done
  step "pytest-$1" $(($2 * 2 > 60 ? $2 * 2 : 60)) $PY -m pytest -q -p no:cacheprovider \
    --durations=10 -rs "${args[@]}"
}

# small_model: the 0.6B shape on a GPU; the demo model without, with tiny sizes in TINY.
small_model() {
  MODEL=0.6B TINY=() PROF_TINY=()
  if [ $GPU = 0 ]; then
    MODEL=$($PY -c 'from benchmarks.models import resolve_model; print(resolve_model(None))')
    TINY=(--num-seqs 8 --min-input-len 16 --max-input-len 64 --min-output-len 8
      --max-output-len 32 --num-kv-blocks 256)
    PROF_TINY=(--steps 5)
  fi
}

part_greedy() {
  step greedy 300 $PY benchmarks/gpu/greedy_checks.py --out "$WORK/greedy" \
    --gpu-memory-utilization 0.5
  cp "$WORK/greedy/greedy_checks.json" "$WORK/" 2>/dev/null
}

part_bench_async() { small_model; bench_one "$MODEL" 0.6B-tp1-async --async-scheduling "${TINY[@]}"; }
part_bench_sync() { small_model; bench_one "$MODEL" 0.6B-tp1-sync --no-async-scheduling "${TINY[@]}"; }

part_profile_256() {
  small_model
  local shape=(--num-seqs 256 --prompt-len 1024)
  [ $GPU = 1 ] || shape=(--num-seqs 4 --prompt-len 16)
  step profile-async-256 150 $PY benchmarks/gpu/profile_decode.py --model "$MODEL" \
    --out "$WORK/profile-async-256" "${shape[@]}" --steps 20 "${PROF_TINY[@]}"
}

part_profile_1() {
  small_model
  step profile-async-1 120 $PY benchmarks/gpu/profile_decode.py --model "$MODEL" \
    --out "$WORK/profile-async-1" --num-seqs 1 --steps 20 "${PROF_TINY[@]}"
}

# part_speculative: benchmarks/speculative.sh (issue 25: repetition workload; none, ngram and a
# draft made of the target's first layer; 1, 4 and 32 sequences, greedy and T=0.8), 0.6B shape.
part_speculative() {
  local model="" blocks=1024
  if [ $GPU = 1 ]; then
    model=$($PY -c 'from benchmarks.models import resolve_model; print(resolve_model("0.6B"))')
    blocks=""  # sized from memory
  fi
  MODEL=$model NUM_KV_BLOCKS=$blocks PYTHON=$PY \
    step speculative 480 bash benchmarks/speculative.sh "$WORK/speculative"
}

# part_eagle3: EAGLE-3 (issue 47) at batch 1, 4, 32 with the tests' tiny target and head (no
# published head reaches the machine): the verify and chain graphs' overhead, not a speed-up.
part_eagle3() { step eagle3 300 $PY -m benchmarks.eagle3 --out-dir "$WORK/eagle3"; }

# part_rl: the RL clients' tests on the device (SGLang's trainer helper from the sglang wheel,
# slime's requests, /update_weights_from_tensor with the engine's tensors on the GPU), then a
# full weight push at TP 1. With one GPU the trainer's group runs over gloo: NCCL refuses two
# ranks (trainer and engine) on one device.
part_rl() {
  step pytest-rl 300 $PY -m pytest -q -p no:cacheprovider -rs tests/test_sglang_clients.py \
    tests/test_weight_updates.py tests/test_tensor_payload.py
  local shape=(--model 0.6B)
  [ $GPU = 1 ] || shape=(--model 0.6B --layers 1 --repeats 1)
  step weight-sync 300 $PY -m benchmarks.weight_sync "${shape[@]}" --tp 1 \
    --out "$WORK/weight-sync-0.6B-tp1.json"
}

# lease: the ledger's parts (LEASE_PARTS, in that order, as `run.sh plan` printed them; else
# what ledger.py orders and fits in the deadline) one after another, each started only if its
# estimate fits in what is left, each recorded in $OUT/ledger.json as it ends.
lease() {
  DEADLINE=${LEASE_DEADLINE:-450}
  LEASE_LEDGER="$OUT/ledger.json"
  local src=${LEDGER:-benchmarks/gpu/ledger.json}
  [ "$src" -ef "$LEASE_LEDGER" ] || cp "$src" "$LEASE_LEDGER"
  local commit=${LEASE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
  local L=(--ledger "$LEASE_LEDGER") gpu_name="cpu (dry run)" dry=(--dry-run) results order
  [ "$FAKE" = 1 ] && gpu_name="fake" dry=()
  env_info
  if [ $GPU = 1 ]; then
    gpu_name=$($PY -c 'import torch; print(torch.cuda.get_device_name(0))') dry=()
  fi
  results=${LEASE_RESULTS_DIR:-benchmarks/results/$($LPY $LEDGER_PY slug "${L[@]}" \
    --gpu "$gpu_name")/$(date -u +%F)}
  order=$($LPY $LEDGER_PY order "${L[@]}" --head "$commit" --parts "${LEASE_PARTS:-}" \
    --budget $((DEADLINE - SECONDS))) || { echo "ledger: no order"; return 1; }
  echo "[$(date +%T) +${SECONDS}s] lease at $commit on $gpu_name, parts:"
  sed 's/^/    /' <<<"$order"
  local name fn est t0
  while read -r -u 3 name fn est; do
    [ -n "$name" ] || continue
    if [ "$est" -gt $((DEADLINE - SECONDS)) ]; then
      echo "[$(date +%T) +${SECONDS}s] part $name: not started (${est}s > $((DEADLINE - SECONDS))s left)"
      continue
    fi
    echo "[$(date +%T) +${SECONDS}s] part $name (about ${est}s)"
    $LPY $LEDGER_PY start "${L[@]}" --part "$name" --head "$commit" --gpu "$gpu_name" "${dry[@]}"
    STEPS_FILE="$WORK/steps-$name.txt"
    : >"$STEPS_FILE"
    t0=$SECONDS
    "$fn" "$name" "$est"
    STEPS_FILE=""
    $LPY $LEDGER_PY record "${L[@]}" --part "$name" --steps "$WORK/steps-$name.txt" \
      --work "$WORK" --results-dir "$results" --seconds $((SECONDS - t0))
    pack
  done 3<<<"$order"
}
