"""The step time pipeline stages add on CPU: the same model and requests at TP 1 x PP 1, TP 1 x
PP 2 and TP 2 x PP 1 (two processes each but the first), decode steps and one prompt's prefill.

    python -m benchmarks.pp_step_time --output-json out.json

One batch is in flight (what is built): stage 1 starts a step only when stage 0 has sent its
hidden states, and rank 0 (stage 0) waits for the logits, so a PP 2 step is both stages' work
in turn plus two hand-offs (hidden + residual, then the logits) and the plan's trip to the
second process. Its difference from PP 1 is the cost of the stages; its difference from TP 2
compares splitting the layers with splitting every layer. Random weights, float32, gloo.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPE = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
             intermediate_size=1536, max_position_embeddings=2048, seed=5)  # fmt: skip
LAYOUTS = [(1, 1), (1, 2), (2, 1)]  # (TP, PP)


def time_layout(model_dir: Path, tp: int, pp: int, batch: int, tokens: int, repeat: int) -> dict:
    from tp_engine import LLM, SamplingParams

    llm = LLM(str(model_dir), tensor_parallel_size=tp, pipeline_parallel_size=pp,
              enable_prefix_caching=False)  # fmt: skip
    try:
        decode = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        prompts = [[11 + i, 12 + i, 13 + i, 14 + i] for i in range(batch)]
        llm.generate(prompts, decode, use_tqdm=False)  # warm-up
        per_step, prefill = [], []
        for _ in range(repeat):
            start = time.perf_counter()
            llm.generate(prompts, decode, use_tqdm=False)
            per_step.append((time.perf_counter() - start) / tokens * 1e3)
            one = SamplingParams(temperature=0.0, max_tokens=1)
            start = time.perf_counter()
            llm.generate([list(range(3, 515))], one, use_tqdm=False)
            prefill.append((time.perf_counter() - start) * 1e3)
    finally:
        llm.shutdown()
    return {
        "tp": tp,
        "pp": pp,
        "decode_step_ms": round(statistics.median(per_step), 2),
        "decode_step_ms_all": [round(x, 2) for x in per_step],
        "prefill_512_ms": round(statistics.median(prefill), 2),
        "prefill_512_ms_all": [round(x, 2) for x in prefill],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8, help="sequences decoding together")
    p.add_argument("--tokens", type=int, default=48, help="decode steps per timed generate")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    from tp_engine.testing import build_random_qwen3

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_qwen3(Path(tmp) / "m", **SHAPE)
        rows: list[dict[str, Any]] = []
        for tp, pp in LAYOUTS:
            rows.append(time_layout(model_dir, tp, pp, args.batch, args.tokens, args.repeat))
            print(rows[-1], flush=True)
    base = rows[0]
    print(f"\n{'layout':<10} {'decode step ms':>15} {'vs PP 1':>9} {'prefill 512 ms':>15}")
    for row in rows:
        added = row["decode_step_ms"] - base["decode_step_ms"]
        print(f"TP{row['tp']} x PP{row['pp']:<3} {row['decode_step_ms']:>15} {added:>+9.2f} "
              f"{row['prefill_512_ms']:>15}")  # fmt: skip
    if args.output_json:
        from benchmarks.results import environment, write_json

        write_json(args.output_json, {"environment": environment(), "shape": SHAPE,
                                      "batch": args.batch, "rows": rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
