"""EAGLE-3 speculative decoding against none: acceptance length and speed-up at batch 1, 4, 32.

    python -m benchmarks.eagle3                       # CPU: the tests' tiny target and head
    python -m benchmarks.eagle3 --model DIR --head HEAD_DIR --tp 2 --out-dir benchmarks/results/gpu/eagle3

Without `--model`, the target is the tests' tiny predictable Qwen3 and the head the one
trained on its greedy continuations (`tp_engine.testing.eagle3_heads.cached_eagle3_pair`:
seeded, 150 steps, built once under the test kit's cache directory). Each batch size runs
greedy `--max-tokens` tokens per random prompt, first without speculation, then with the head
(k = `--k`); the tokens must be the same. Reports output tokens per second (the fastest of
`--repeats` timed calls, after one warm-up call per engine), mean acceptance length (tokens per
verify step, 1 + accepted / verify steps), acceptance per draft position and the speed-up.
Writes `eagle3.json` and the raw log `eagle3.log` to `--out-dir` (default
`benchmarks/results/<cpu|gpu>/eagle3/`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def run(args: argparse.Namespace, head: str | None, batch: int, log: list[str]) -> dict[str, Any]:
    from tp_engine import LLM, SamplingParams

    spec = None if head is None else {
        "method": "eagle3", "model": head, "num_speculative_tokens": args.k}  # fmt: skip
    llm = LLM(
        args.model, tensor_parallel_size=args.tp, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, max_model_len=args.max_model_len,
        max_num_seqs=max(batch, 1), speculative_config=spec, enable_prefix_caching=False,
    )  # fmt: skip
    try:
        vocab = llm.get_tokenizer().vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        warm = _prompts(batch, args.prompt_len, vocab, seed=99)
        llm.generate([{"prompt_token_ids": p} for p in warm], params, use_tqdm=False)
        before = llm.engine.spec_stats.num_drafts if head else 0
        before_acc = llm.engine.spec_stats.num_accepted_tokens if head else 0
        before_pos = list(llm.engine.spec_stats.accepted_per_pos) if head else []
        prompts = _prompts(batch, args.prompt_len, vocab, seed=args.seed)
        times = []
        for _ in range(args.repeats):  # the best of a few: a shared CPU's load comes and goes
            start = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        elapsed = min(times)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        result: dict[str, Any] = {
            "batch": batch, "method": "eagle3" if head else "none", "seconds": elapsed,
            "seconds_each": times,
            "output_tokens_per_s": sum(len(t) for t in tokens) / elapsed,
        }  # fmt: skip
        if head:
            s = llm.engine.spec_stats
            steps, acc = s.num_drafts - before, s.num_accepted_tokens - before_acc
            result["verify_steps"] = steps
            result["mean_acceptance_length"] = 1 + acc / max(steps, 1)
            result["accepted_per_pos"] = [
                a - b for a, b in zip(s.accepted_per_pos, before_pos, strict=True)
            ]
        log.append(f"batch {batch:>2} {result['method']:>6}: {json.dumps(result)}")
        print(log[-1], flush=True)
        return {**result, "tokens": tokens}
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="target directory (default: the tiny one)")
    p.add_argument("--head", default=None, help="EAGLE-3 head directory (needs --model)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--k", type=int, default=3, help="drafts per step")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 32])
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-model-len", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=512)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="timed runs; the fastest counts")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    kind = "gpu" if torch.cuda.is_available() else "cpu"
    out = Path(args.out_dir or f"benchmarks/results/{kind}/eagle3")
    out.mkdir(parents=True, exist_ok=True)
    log = ["$ python -m benchmarks.eagle3 " + " ".join(sys.argv[1:] if argv is None else argv)]
    # A shared CPU's load moves every figure: recorded beside them.
    log.append(f"load average at start: {os.getloadavg()}")
    if args.model is None:
        from tp_engine.testing.eagle3_heads import cached_eagle3_pair

        args.model, args.head = map(str, cached_eagle3_pair())
    elif args.head is None:
        p.error("--model needs --head")
    rows = []
    for batch in args.batches:
        base = run(args, None, batch, log)
        spec = run(args, args.head, batch, log)
        if spec.pop("tokens") != base.pop("tokens"):
            raise SystemExit(f"batch {batch}: the tokens differ with EAGLE-3")
        spec["speedup"] = spec["output_tokens_per_s"] / base["output_tokens_per_s"]
        rows += [base, spec]
        log.append(f"batch {batch:>2} speed-up {spec['speedup']:.2f}x, mean acceptance "
                   f"length {spec['mean_acceptance_length']:.2f}")  # fmt: skip
        print(log[-1], flush=True)
    log.append(f"load average at end: {os.getloadavg()}")
    record = {"args": vars(args), "load_average": [log[1], log[-1]], "results": rows}
    (out / "eagle3.json").write_text(json.dumps(record, indent=2))
    (out / "eagle3.log").write_text("\n".join(log) + "\n")


if __name__ == "__main__":
    main()
