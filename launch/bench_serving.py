"""Serving benchmark for any OpenAI-compatible server (ours, vLLM, SGLang).

    python launch/serve.py --port 8000 &                         # the demo model
    python launch/bench_serving.py --base-url http://127.0.0.1:8000 --model tp-engine-demo \\
        --dataset-name random --random-input-len 128 --random-output-len 64 \\
        --num-prompts 100 --request-rate 4 --max-concurrency 32
    python launch/bench_serving.py ... --dataset-name sharegpt --dataset-path ShareGPT_V3.json
    python launch/bench_serving.py ... --random-as-text        # through sglang-router (text only)

Every request is a streamed `/v1/completions` call with `ignore_eos` (so the output length is
the one asked for) and `stream_options.include_usage` (token counts from the server). Requests
arrive as a Poisson process at `--request-rate` per second (`--burstiness` != 1: gamma gaps), or
all at once with `inf`. Prints vLLM's "Serving Benchmark Result" block and writes a JSON file
with every figure and the per-request TTFT, latency and ITL lists (for the latency plots).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from pathlib import Path

# The benchmark harness (`benchmarks/`) lives in the checkout, not in the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results import environment, write_json
from benchmarks.serving_client import (
    MIN_CHUNK_COVERAGE,
    compute_metrics,
    format_result_block,
    random_requests,
    run_benchmark,
    sharegpt_requests,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument(
        "--model", default=None, help="the 'model' field; default: the first of /v1/models"
    )
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset-name", choices=["random", "sharegpt"], default="random")
    p.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument(
        "--random-vocab-size", type=int, default=10_000,
        help="token ids are drawn from [0, this); keep it within the served model's vocabulary",
    )  # fmt: skip
    p.add_argument(
        "--random-as-text",
        action="store_true",
        help="random prompts as words, not token ids (sglang-router takes only text prompts)",
    )
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="req/s; inf = all at once"
    )
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--min-chunk-coverage", type=float, default=MIN_CHUNK_COVERAGE,
        help="text-bearing streamed chunks per output token below which TPOT and ITL are "
        "refused (per-token timing was not observed); lower it for multi-token chunks "
        "(speculative decoding)",
    )  # fmt: skip
    p.add_argument("--label", default=None, help="free text stored in the result file")
    p.add_argument(
        "--output-json", default=None, help="default benchmarks/results/serving-<time>.json"
    )
    return p.parse_args(argv)


def first_served_model(base_url: str, api_key: str | None) -> str:
    req = urllib.request.Request(base_url.rstrip("/") + "/v1/models")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.load(resp)["data"][0]["id"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model is None:
        args.model = first_served_model(args.base_url, args.api_key)
    if args.dataset_name == "sharegpt":
        if not args.dataset_path:
            raise SystemExit("--dataset-name sharegpt needs --dataset-path")
        requests = sharegpt_requests(
            args.dataset_path, args.num_prompts, args.sharegpt_output_len, args.seed
        )
    else:
        requests = random_requests(
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.random_vocab_size,
            args.seed,
            as_text=args.random_as_text,
        )
    print(f"{len(requests)} requests to {args.base_url}, rate {args.request_rate}, "
          f"max concurrency {args.max_concurrency}", flush=True)  # fmt: skip
    results, duration = asyncio.run(
        run_benchmark(
            args.base_url,
            args.model,
            requests,
            args.request_rate,
            args.max_concurrency,
            args.api_key,
            args.burstiness,
            args.seed,
        )
    )
    metrics = compute_metrics(results, duration, args.min_chunk_coverage)
    print(format_result_block(metrics, args.max_concurrency, args.request_rate), flush=True)
    errors = sorted({r.error for r in results if not r.success})
    for error in errors:
        print(f"failed request: {error}")
    env = environment()
    del env["device"], env["device_kind"]  # the client's machine says nothing about the server
    result = {
        "benchmark": "serving",
        **env,
        "label": args.label,
        "base_url": args.base_url,
        "model": args.model,
        "args": {k: v for k, v in vars(args).items() if k != "api_key"},
        "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
        **metrics.as_dict(),
        "errors": errors,
        "ttfts_s": [r.ttft_s for r in results if r.success],
        "latencies_s": [r.latency_s for r in results if r.success],
        "output_lens": [r.output_len for r in results if r.success],
        "itls_s": [r.itl_s for r in results if r.success],
    }
    path = (
        args.output_json
        or Path("benchmarks/results") / f"serving-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    write_json(path, result)
    print(f"Result: {path}")
    return 0 if metrics.completed else 1


if __name__ == "__main__":
    raise SystemExit(main())
