#!/usr/bin/env bash
# The FP8 test checkpoint of the Qwen3-8B widths used by the CPU figures: hidden 4096, 32 query
# and 8 KV heads of 128, intermediate 12288, but 2 layers (not 36) and the test tokenizer's
# 643-token vocabulary (not 151936), so that it fits 24 GB and 2 cores.
set -euo pipefail
OUT=${1:-/tmp/qwen3-8B-widths-2L}
python - "$OUT" <<'PY'
import sys
from pathlib import Path
from tp_engine.checkpoints import build_random_qwen3, quantize_checkpoint_fp8
out = Path(sys.argv[1])
src = build_random_qwen3(out / "bf16", hidden_size=4096, num_layers=2, num_heads=32,
                         num_kv_heads=8, head_dim=128, intermediate_size=12288,
                         max_position_embeddings=4096, dtype="bfloat16", seed=0)
quantize_checkpoint_fp8(src, out / "fp8")
PY
