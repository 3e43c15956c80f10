"""Multi-turn chat with histories larger than the GPU's KV pool, without tiers below it, with the
host tier, with the host and file tiers, and with both after a restart (in the manner of SGLang's
`bench_multiturn.py`, offline).

    python -m benchmarks.multiturn                                # the demo model, CPU sizes
    python -m benchmarks.multiturn --model DIR --tp 2 --conversations 32 --turns 6 \\
        --num-kv-blocks 256 --offload-gib 4

`--conversations` conversations each take `--turns` turns; a turn's prompt is its history (every
earlier prompt and answer) plus `--user-tokens` new tokens, and the answer `--output-tokens`
tokens (greedy). Each round sends every conversation's next turn in one call, after the prefill
alone is timed (`max_tokens=1`, the round's time to first token for its whole batch; the
engine's prefix cache serves the timed prefill's blocks to the full turn, so both runs pay it
alike). The device pool (`--num-kv-blocks`) is kept far smaller than the histories, so without
the tier a returning conversation recomputes its history. Reports, per configuration, the
prefill time per round and the prompt tokens computed (all prompt tokens minus those found in
the device pool and below it), and checks that every configuration produces the same tokens.
Writes `multiturn.json` and the raw log `multiturn.log` to `--out-dir` (default
`benchmarks/results/<cpu|gpu>/<date>/`).
"""

from __future__ import annotations

import argparse
import datetime
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def run(
    args: argparse.Namespace, offload_gib: float | None, log: list[str], file_dir: str | None = None
) -> dict[str, Any]:
    from tp_engine import LLM, SamplingParams

    llm = LLM(
        args.model, tensor_parallel_size=args.tp, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, max_model_len=args.max_model_len,
        kv_offloading_size=offload_gib, kv_offloading_dir=file_dir,
    )  # fmt: skip
    try:
        vocab = llm.get_tokenizer().vocab_size
        g = torch.Generator().manual_seed(args.seed)
        new = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
        histories = [new(args.first_tokens) for _ in range(args.conversations)]
        answer = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
        first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        rounds, tokens, prompt_tokens = [], [], 0
        for turn in range(args.turns):
            batch = [{"prompt_token_ids": h} for h in histories]
            start = time.perf_counter()
            llm.generate(batch, first, use_tqdm=False)
            prefill_s = time.perf_counter() - start
            outputs = llm.generate(batch, answer, use_tqdm=False)
            answers = [list(o.outputs[0].token_ids) for o in outputs]
            tokens.append(answers)
            prompt_tokens += 2 * sum(len(h) for h in histories)  # both calls look them up
            rounds.append({"turn": turn, "prefill_s": prefill_s,
                           "history_tokens": sum(len(h) for h in histories)})  # fmt: skip
            log.append(f"  turn {turn}: prefill of {len(histories)} histories {prefill_s:.3f} s")
            histories = [
                h + a + new(args.user_tokens) for h, a in zip(histories, answers, strict=True)
            ]
        stats = llm.engine.stats()
        found = stats.prefix_cache_hits + stats.external_prefix_cache_hits
        host = llm.engine.core.host_tier
        files = None if host is None else host.lower
        return {
            "kv_offloading_size_gib": offload_gib,
            "kv_offloading_dir": file_dir,
            "file_tier_hits_tokens": 0 if files is None else files.hits * args.block_size,
            "rounds": rounds,
            "prefill_s_total": sum(r["prefill_s"] for r in rounds),
            "prompt_tokens": prompt_tokens,
            "prompt_tokens_computed": prompt_tokens - found,
            "device_prefix_hits": stats.prefix_cache_hits,
            "external_prefix_hits": stats.external_prefix_cache_hits,
            "tokens": tokens,
        }
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> int:
    from benchmarks.results import environment, write_json

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-tokens", type=int, default=96)
    p.add_argument("--user-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=40, help="the device pool, in blocks")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--offload-gib", type=float, default=0.25, help="the host tier, GiB per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args(argv)
    kind = "gpu" if torch.cuda.is_available() else "cpu"
    out_dir = args.out_dir or Path("benchmarks/results") / kind / str(datetime.date.today())
    out_dir.mkdir(parents=True, exist_ok=True)
    log = [f"$ python -m benchmarks.multiturn {' '.join(argv or [])}".rstrip()]
    results = {}
    with tempfile.TemporaryDirectory(prefix="kv-files-") as file_dir:
        configurations = (
            ("without_tier", None, None),
            ("host_tier", args.offload_gib, None),
            # The file tier written through from the host tier, then a new engine (a restart:
            # empty GPU pool and host memory) on the same directory.
            ("file_tier", args.offload_gib, file_dir),
            ("file_tier_restarted", args.offload_gib, file_dir),
        )
        for name, gib, directory in configurations:
            log.append(f"{name}:")
            results[name] = run(args, gib, log, directory)
            r = results[name]
            log.append(
                f"  prefill {r['prefill_s_total']:.3f} s over {args.turns} rounds; prompt tokens "
                f"computed {r['prompt_tokens_computed']} of {r['prompt_tokens']} (device hits "
                f"{r['device_prefix_hits']}, hits below {r['external_prefix_hits']}, of them "
                f"from files {r['file_tier_hits_tokens']})"
            )
    tokens = [r.pop("tokens") for r in results.values()]
    same = all(t == tokens[0] for t in tokens)
    log.append(f"same tokens in every configuration: {same}")
    print("\n".join(log))
    write_json(out_dir / "multiturn.json", {
        "environment": environment(), "args": vars(args) | {"out_dir": str(out_dir)},
        "same_tokens": same, **results,
    })  # fmt: skip
    (out_dir / "multiturn.log").write_text("\n".join(log) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
