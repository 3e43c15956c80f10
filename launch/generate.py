"""Offline generation from the command line: prompts in, completions out.

    python launch/generate.py --prompt "Hello, my name is"                 # demo model, TP=1
    python launch/generate.py --tensor-parallel-size 2 --prompt "Hi"        # spawns rank 1
    torchrun --nproc-per-node 2 launch/generate.py --model DIR --prompt "Hi"

Without --model it uses the built-in demo checkpoint (random weights: the text is gibberish,
but every part of the engine runs). Under torchrun only rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import sys

from tp_engine import LLM, SamplingParams
from tp_engine.config.flags import add_engine_flags, engine_kwargs
from tp_engine.config.help_format import HelpFormatter

DEFAULT_PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "Tensor parallelism splits every layer",
    "Once upon a time",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=None,
        help="ranks (default: torchrun's WORLD_SIZE, else 1; N > 1 without torchrun starts "
        "N - 1 worker processes)",
    )
    p.add_argument(
        "--dist-backend",
        choices=["nccl", "gloo"],
        default=None,
        help="collectives between ranks (default: nccl with GPUs, gloo on CPU)",
    )
    p.add_argument(
        "--prompt", action="append", help="a prompt (repeatable; default: four sample prompts)"
    )
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    # The engine's flags: the one table every script reads (`tp_engine.config.flags`).
    add_engine_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object per completion")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    llm = LLM(
        args.model,
        tensor_parallel_size=args.tensor_parallel_size,
        dist_backend=args.dist_backend,
        **engine_kwargs(args),
    )
    prompts = args.prompt or DEFAULT_PROMPTS
    if args.chat:
        tok = llm.get_tokenizer()
        prompts = [
            tok.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in prompts
        ]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty())
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outputs, strict=True):
        completion = out.outputs[0]
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": completion.text,
                        "token_ids": completion.token_ids,
                        "finish_reason": completion.finish_reason,
                    }
                )
            )
        else:
            print(
                f"prompt: {prompt!r}\ncompletion: {completion.text!r} ({completion.finish_reason})\n"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
