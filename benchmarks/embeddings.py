"""Embedding throughput: sequences per second of `LLM.embed` at a few batch sizes and lengths.

    python -m benchmarks.embeddings                      # the demo model, served as an embedder
    python -m benchmarks.embeddings --model DIR --tp 2 --batch-sizes 1,16,64 --lengths 128,512

Each (batch size, length) point embeds `batch` random prompts of `length` tokens (distinct first
tokens, prefix caching off: every token is computed) `--repeats` times after one warm-up run,
and reports the best and median wall time as sequences/s and prompt tokens/s. A model without
sentence-transformers files is served with `runner="pooling"` (last-token pooling of its
body, vLLM's default conversion), which is what the demo model measures: the body's cost.
Writes `embeddings.json` and the raw log `embeddings.log` to `--out-dir` (default
`benchmarks/results/<cpu|gpu>/<date>/`).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path
from typing import Any

import torch


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g).tolist()


def _point(llm: Any, batch: int, length: int, repeats: int) -> dict[str, Any]:
    """Time one (batch size, length) point; a new random batch per run."""
    vocab = len(llm.tokenizer)
    llm.embed(_prompts(batch, length, vocab, seed=0), use_tqdm=False)  # warm-up
    seconds = []
    for run in range(repeats):
        prompts = _prompts(batch, length, vocab, seed=run + 1)
        start = time.perf_counter()
        llm.embed(prompts, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    best, median = min(seconds), statistics.median(seconds)
    return {
        "batch_size": batch,
        "prompt_len": length,
        "seconds": seconds,
        "seqs_per_s_best": batch / best,
        "seqs_per_s_median": batch / median,
        "prompt_tokens_per_s_median": batch * length / median,
    }


def main() -> None:
    from benchmarks.results import REPO_ROOT, environment, write_json
    from tp_engine import LLM
    from tp_engine.demo import demo_checkpoint_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the demo)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--lengths", default="32,128,512")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()

    model = args.model or str(demo_checkpoint_dir())
    kind = "gpu" if torch.cuda.is_available() else "cpu"
    today = datetime.date.today().isoformat()
    out_dir = Path(args.out_dir or REPO_ROOT / "benchmarks" / "results" / kind / today)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = (out_dir / "embeddings.log").open("w")

    def say(line: str) -> None:
        print(line, flush=True)
        log.write(line + "\n")

    batches = [int(b) for b in args.batch_sizes.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]
    llm = LLM(
        model, tensor_parallel_size=args.tp, runner="pooling", enable_prefix_caching=False,
        max_num_seqs=max(batches), max_model_len=max(lengths) + 1,
        **({} if kind == "gpu" else {"num_kv_blocks": 4096}),
    )  # fmt: skip
    points = []
    try:
        say(f"model {model} (task {llm.engine.model_spec.task}), tp {args.tp}, {kind}")
        for length in lengths:
            for batch in batches:
                point = _point(llm, batch, length, args.repeats)
                points.append(point)
                say(f"batch {batch:4d} x {length:5d} tokens: "
                    f"{point['seqs_per_s_median']:9.1f} seq/s (best "
                    f"{point['seqs_per_s_best']:.1f}), "
                    f"{point['prompt_tokens_per_s_median']:10.0f} prompt tok/s")  # fmt: skip
    finally:
        llm.shutdown()
        log.close()
    result = {
        "benchmark": "embeddings",
        "model": model,
        "tensor_parallel_size": args.tp,
        "repeats": args.repeats,
        "points": points,
        "environment": environment(),
    }
    print(write_json(out_dir / "embeddings.json", result))


if __name__ == "__main__":
    main()
