"""Multi-LoRA on one rank: forward time of a step with 0, 1, 4 and 16 distinct adapters in the
batch against the same step without LoRA, and the time to load an adapter into a slot. (The
engine's throughput and `add_lora` latency are `benchmarks/lora.py`'s; this one isolates the
rank's share: the layers' LoRA terms and the LOAD_LORA call, no scheduling or sampling.)

    python -m benchmarks.lora_runner --model 0.6B --layers 2 --out benchmarks/results/cpu/lora/0.6B-2layers.json

The model is random, of a real Qwen3 shape (`benchmarks.models`, `--layers` keeps the first
layers: the result says so), the adapters random PEFT files of rank `--rank` on all seven
projections of every layer. Steps are the runner's own (`ModelRunner.execute`, eager or, on a
GPU, decode graphs): a decode batch of `--batch` sequences at `--context` tokens, and a
prefill of `--prefill` tokens over `--batch` sequences; each sequence's adapter is taken round
robin from the n loaded ones (n = 0: LoRA on, every sequence on the base model). Load times
are LOAD_LORA control calls (both phases, on this one rank): from disk (read, checked, cut and
copied) and from the host LRU (cut and copied).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ADAPTER_COUNTS = (0, 1, 4, 16)
_PROJS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def write_random_adapter(out: Path, hf_config: Any, rank: int, seed: int) -> Path:
    """A PEFT adapter directory of rank `rank` on every projection of every layer."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    h, hd = hf_config.hidden_size, hf_config.head_dim
    q, kv, inter = hf_config.num_attention_heads * hd, hf_config.num_key_value_heads * hd, None
    inter = hf_config.intermediate_size
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}  # fmt: skip
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for block, projs in _PROJS.items():
            for proj in projs:
                out_f, in_f = shapes[proj]
                key = f"base_model.model.model.layers.{layer}.{block}.{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) / in_f**0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    config = {"r": rank, "lora_alpha": 2 * rank, "bias": "none", "peft_type": "LORA",
              "target_modules": [p for ps in _PROJS.values() for p in ps]}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def step_plan(num_seqs: int, new_tokens: int, context: int, block_size: int, slots: list[int]):
    """A RUN plan of `num_seqs` sequences, each computing `new_tokens` at the end of
    `context` tokens, in rows 0.. with blocks of their own; `slots` per sequence."""

    from rank_worker.runner.model_runner import synthetic_plan

    width = -(-context // block_size)
    seqs = [
        (context - new_tokens, new_tokens, list(range(i * width, (i + 1) * width)))
        for i in range(num_seqs)
    ]
    plan = synthetic_plan(seqs)
    return plan.with_sections(adapter_slots=np.array(slots, dtype=np.int32))


def _time_steps(runner: Any, plan: Any, repeats: int) -> float:
    """Median seconds of `runner.execute(plan)` (after one warm-up step)."""
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    runner.execute(plan)
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.execute(plan)
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    import rank_worker.control.lora_ops  # noqa: F401  (registers the LoRA ops)
    from benchmarks.models import QWEN3_PRESETS
    from benchmarks.results import environment, write_json
    from rank_worker.control.protocol import ControlOp, RankControl
    from rank_worker.runner.model_runner import ModelRunner, load_hf_config
    from rank_worker.runner_config import RunnerConfig
    from rank_worker.tp import TPInfo
    from shm_ipc import ControlCall
    from tp_engine.testing import build_random_qwen3, cache_dir, cached_random_qwen3

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="0.6B", choices=sorted(QWEN3_PRESETS))
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = dict(QWEN3_PRESETS[args.model])
    if args.layers is not None:
        shape["num_layers"] = args.layers
    name = f"lora-bench-{args.model}-{shape['num_layers']}layers"
    ckpt = cached_random_qwen3(name, builder=build_random_qwen3, dtype="bfloat16", **shape)
    hf_config = load_hf_config(ckpt)
    adapter_root = cache_dir() / f"{name}-adapters-r{args.rank}"
    adapters = [
        write_random_adapter(adapter_root / f"a{i}", hf_config, args.rank, seed=i)
        for i in range(max(ADAPTER_COUNTS))
    ]
    block_size, max_loras = 16, max(ADAPTER_COUNTS)
    width = -(-args.context // block_size)
    prefill_per_seq = max(1, args.prefill // args.batch)

    def runner_with(enable_lora: bool) -> ModelRunner:
        config = RunnerConfig(
            max_model_len=max(args.context, prefill_per_seq), block_size=block_size,
            max_num_seqs=args.batch, max_num_batched_tokens=max(args.prefill, args.batch),
            num_kv_blocks=args.batch * width + 1, dtype=args.dtype, enable_lora=enable_lora,
            max_loras=max_loras, max_lora_rank=args.rank,
        )  # fmt: skip
        runner = ModelRunner(ckpt, config, TPInfo(0, 1), device)
        runner.init_kv_cache(config.num_kv_blocks)
        return runner

    decode = {"lora_off": None}
    prefill = {"lora_off": None}

    def measure(runner: ModelRunner, key: str, count: int | None) -> None:
        slots = [-1 if not count else i % count for i in range(args.batch)]
        plan = step_plan(args.batch, 1, args.context, block_size, slots)
        decode[key] = _time_steps(runner, plan, args.repeats)
        plan = step_plan(args.batch, prefill_per_seq, prefill_per_seq, block_size, slots)
        prefill[key] = _time_steps(runner, plan, args.repeats)
        print(f"{key}: decode {decode[key] * 1e3:.2f} ms, prefill {prefill[key] * 1e3:.2f} ms",
              flush=True)  # fmt: skip

    base = runner_with(False)
    measure(base, "lora_off", None)
    base.release()
    del base
    runner = runner_with(True)
    control = RankControl(runner, TPInfo(0, 1))

    def load(slot: int, uid: str, path: Path) -> float:
        start = time.perf_counter()
        result = control.run(ControlCall(0, int(ControlOp.LOAD_LORA),
                                         {"slot": slot, "lora_uid": uid, "path": str(path)}))  # fmt: skip
        if device == "cuda":
            torch.cuda.synchronize()
        if not result.ok:
            raise RuntimeError(result.message)
        return time.perf_counter() - start

    from_disk = [load(i, f"a{i}", path) for i, path in enumerate(adapters)]
    from_host = [load(0, "a0", adapters[0]) for _ in range(args.repeats)]
    print(f"load from disk {statistics.median(from_disk) * 1e3:.1f} ms, from the host LRU "
          f"{statistics.median(from_host) * 1e3:.1f} ms", flush=True)  # fmt: skip
    for count in ADAPTER_COUNTS:
        measure(runner, f"{count}_adapters", count)
    result = {
        "benchmark": "lora_runner",
        "model_shape": args.model,
        "num_layers": shape["num_layers"],
        "truncated": args.layers is not None,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "rank": args.rank,
        "batch": args.batch,
        "decode_context": args.context,
        "prefill_tokens": prefill_per_seq * args.batch,
        "lora_slot_bytes": runner.lora.nbytes,
        "decode_step_s": decode,
        "prefill_step_s": prefill,
        "load_from_disk_s": statistics.median(from_disk),
        "load_from_host_lru_s": statistics.median(from_host),
        # Other processes' load on the host while it ran: on a shared CPU the step times are
        # theirs as much as ours (compare runs only at a low load).
        "load_average_1min": os.getloadavg()[0],
        "environment": environment(),
    }
    print(f"wrote {write_json(args.out, result)}")


if __name__ == "__main__":
    main()
