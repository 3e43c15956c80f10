#!/usr/bin/env bash
# Offline speculative decoding against none, on a workload that repeats itself, on CPU.
#
#   bash benchmarks/speculative.sh [OUT_DIR]    (default benchmarks/results/cpu/speculative)
#
# `launch/bench.py --workload repetition` (each prompt a random passage repeated --copies
# times, every sequence generating --max-output-len tokens) on the demo model, at 1, 4 and 32
# sequences ($NUM_SEQS), greedy and at temperature 0.8, three ways: no speculation, n-gram
# lookup (k = 4), and a draft model (k = 4) made of the demo model's first layer
# (`tp_engine.testing.truncate_layers`). Writes one result JSON and raw log per run,
# COMMANDS (every command as run) and summary.json / summary.md (output tokens per second,
# mean acceptance length, speed-up against no speculation). Extra bench.py arguments go in
# $BENCH_ARGS; $MODEL picks another checkpoint (its first layer is then the draft).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/cpu/speculative}
PY=${PYTHON:-python}
mkdir -p "$OUT"
: > "$OUT/COMMANDS"
NUM_KV_BLOCKS=${NUM_KV_BLOCKS-1024}  # set it empty to size the pool from memory (GPU)
[ -n "${MODEL:-}" ] || MODEL=$("$PY" -c 'from tp_engine.testing import demo_checkpoint_dir as d; print(d())')
DRAFT=$(mktemp -d)/draft
trap 'rm -rf "$(dirname "$DRAFT")"' EXIT
"$PY" -c "import sys; from tp_engine.testing import truncate_layers as t; t(sys.argv[1], sys.argv[2], 1)" "$MODEL" "$DRAFT"

NGRAM='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
DRAFTCFG="{\"method\": \"draft_model\", \"model\": \"$DRAFT\", \"num_speculative_tokens\": 4}"
for N in ${NUM_SEQS:-1 4 32}; do
for TEMP in 0 0.8; do
    for NAME in none ngram draft; do
        SPEC=()
        [ "$NAME" = ngram ] && SPEC=(--speculative-config "$NGRAM")
        [ "$NAME" = draft ] && SPEC=(--speculative-config "$DRAFTCFG")
        RUN=("$PY" launch/bench.py --model "$MODEL" --workload repetition --num-seqs "$N"
             --passage-len 32 --copies 4 --max-output-len 128 --temperature "$TEMP"
             --max-model-len 512 ${NUM_KV_BLOCKS:+--num-kv-blocks $NUM_KV_BLOCKS} "${SPEC[@]}"
             --output-json "$OUT/bench-$NAME-n$N-t$TEMP.json" ${BENCH_ARGS:-})
        printf '%q ' "${RUN[@]}" >> "$OUT/COMMANDS"; echo >> "$OUT/COMMANDS"
        "${RUN[@]}" 2>&1 | tee "$OUT/bench-$NAME-n$N-t$TEMP.log"
    done
done
done

"$PY" - "$OUT" ${NUM_SEQS:-1 4 32} <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
rows = []
for (n, temp) in [(n, t) for n in sys.argv[2:] for t in ("0", "0.8")]:
    base = json.loads((out / f"bench-none-n{n}-t{temp}.json").read_text())["output_tokens_per_s"]
    for name in ("none", "ngram", "draft"):
        r = json.loads((out / f"bench-{name}-n{n}-t{temp}.json").read_text())
        spec = r.get("speculative") or {}
        rows.append({
            "num_seqs": int(n), "temperature": float(temp), "method": name,
            "output_tokens_per_s": r["output_tokens_per_s"],
            "speedup": r["output_tokens_per_s"] / base,
            "mean_acceptance_length": spec.get("mean_acceptance_length"),
            "accepted_of_draft_tokens": [spec.get("num_accepted_tokens"), spec.get("num_draft_tokens")],
            "device": r["device"], "commit": r.get("commit"),
        })
(out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
lines = ["| sequences | temperature | method | output tok/s | vs none | mean acceptance length | accepted / drafted |",
         "| --- | --- | --- | --- | --- | --- | --- |"]
for r in rows:
    mal = "" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
    acc = "" if r["method"] == "none" else "{} / {}".format(*r["accepted_of_draft_tokens"])
    lines.append(f"| {r['num_seqs']} | {r['temperature']} | {r['method']} | {r['output_tokens_per_s']:.1f} | "
                 f"{r['speedup']:.2f}x | {mal} | {acc} |")
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
