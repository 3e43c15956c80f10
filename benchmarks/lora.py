"""Multi-LoRA throughput and adapter load latency (CPU now; the same script on a GPU).

    python -m benchmarks.lora --out benchmarks/results/cpu/2026-11-27/lora.json

One engine with `enable_lora` (16 slots) runs the same batch of greedy requests with 0, 1, 4
and 16 distinct adapters spread over the requests (round robin; 0: every request on the base
model), and a second engine without LoRA runs it as the baseline; the configurations take
turns, `--repeats` rounds, and each keeps its fastest round. Adapters are random PEFT
files (all seven projections, rank `--rank`) written here; the model is a random Qwen3 of
`--model`'s shape (`benchmarks.models`, `--layers` keeps the first layers). Load latency is
`LLMEngine.add_lora` of an adapter no rank holds: rank 0's config check, then the LOAD_LORA
control call (every rank reads the file and writes its slot).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

PROJECTIONS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def write_adapter(out: Path, config: dict[str, Any], rank: int, seed: int) -> Path:
    """A PEFT adapter on every projection of every layer, random A and B (B non-zero)."""
    from safetensors.torch import save_file

    h, i = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for block, projs in PROJECTIONS.items():
            for proj in projs:
                fan_in, fan_out = shapes[proj]
                key = f"base_model.model.model.layers.{layer}.{block}.{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    peft_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
                   "target_modules": [p for ps in PROJECTIONS.values() for p in ps]}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(peft_config))
    return out


def run_batch(llm: Any, prompts: list[list[int]], loras: list[Any], max_tokens: int) -> float:
    """Seconds to run every prompt to `max_tokens` greedy tokens."""
    from tp_engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                 lora_request=loras)  # fmt: skip
    return time.perf_counter() - start


def main() -> None:
    from benchmarks.models import QWEN3_PRESETS
    from benchmarks.results import environment, write_json
    from tp_engine import LLM, LoRARequest
    from tp_engine.testing import build_random_qwen3

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="0.6B", choices=sorted(QWEN3_PRESETS))
    ap.add_argument("--layers", type=int, default=2, help="keep only the first N layers")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    shape = dict(QWEN3_PRESETS[args.model], num_layers=args.layers)
    root = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    ckpt = build_random_qwen3(root / "base", **shape)
    config = json.loads((ckpt / "config.json").read_text())
    adapters = [write_adapter(root / f"a{k}", config, args.rank, k) for k in range(32)]
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, config["vocab_size"], (args.prompt_len,), generator=g).tolist()
        for _ in range(args.requests)
    ]
    knobs = dict(max_num_seqs=args.requests, max_model_len=args.prompt_len + args.max_tokens,
                 num_kv_blocks=4 * args.requests, block_size=16, enable_prefix_caching=False)  # fmt: skip

    def loras_of(n: int) -> list[Any]:
        """`n` adapters round robin over the requests (0: all on the base model)."""
        if n == 0:
            return [None] * args.requests
        return [
            LoRARequest(f"a{r % n}", r % n + 1, str(adapters[r % n])) for r in range(args.requests)
        ]

    base = LLM(str(ckpt), **knobs)
    llm = LLM(str(ckpt), enable_lora=True, max_loras=16, max_lora_rank=args.rank,
              max_cpu_loras=32, **knobs)  # fmt: skip
    # Each configuration: the engine and the adapters of its requests.
    configs = {"lora_off": (base, loras_of(0))}
    configs |= {f"adapters_{n}": (llm, loras_of(n)) for n in (0, 1, 4, 16)}
    seconds: dict[str, list[float]] = {name: [] for name in configs}
    results: dict[str, Any] = {}
    try:
        for engine, loras in configs.values():  # warm-up, and every adapter's first load
            run_batch(engine, prompts, loras, 2)
        # Interleaved rounds, the fastest of each kept: a shared machine's load comes and goes.
        for round_ in range(args.repeats):
            for name, (engine, loras) in configs.items():
                seconds[name].append(run_batch(engine, prompts, loras, args.max_tokens))
                print(f"round {round_} {name}: {seconds[name][-1]:.2f} s", flush=True)
        tokens = args.requests * args.max_tokens
        for name, secs in seconds.items():
            results[name] = {"seconds": min(secs), "output_tokens_per_s": tokens / min(secs),
                             "all_seconds": secs}  # fmt: skip
            print(name, results[name], flush=True)
        loads = []
        for k in range(16, 32):  # adapters no rank has read yet, into slots nothing pins
            start = time.perf_counter()
            llm.engine.add_lora(LoRARequest(f"a{k}", k + 1, str(adapters[k])))
            loads.append(time.perf_counter() - start)
        results["adapter_load_s"] = {"median": statistics.median(loads), "max": max(loads),
                                     "count": len(loads)}  # fmt: skip
        print("adapter load:", results["adapter_load_s"], flush=True)
    finally:
        llm.shutdown()
        base.shutdown()
    write_json(args.out, {
        "benchmark": "lora",
        "model_shape": args.model, "num_layers": args.layers, "truncated": True,
        "lora_rank": args.rank, "requests": args.requests, "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens, "results": results, "environment": environment(),
    })  # fmt: skip


if __name__ == "__main__":
    main()
