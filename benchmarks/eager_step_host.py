"""The host's share of an eager (not graph-captured) step, measured without a GPU.

    python -m benchmarks.eager_step_host --output-json OUT.json [--layers 28] [--prompt-len 1024]

A step that carries a prefill runs eagerly (CUDA graphs capture decode-only batches), so rank
0's Python issues every operation of every layer: the module calls, the kernel wrappers'
checks and grids, the attention backend's split of the batch, and one launch per kernel. When
that takes longer than the kernels themselves, the GPU waits for the host and the step lasts
as long as the Python does. This runs the model runner's real `execute` on CPU with the
Triton path (the wrappers run as on a GPU) but every Triton launch skipped (it returns at once,
`benchmarks.triton_launches.triton_launch_hook`) and layers of a few dozen features, so that
the torch operations cost little more than their dispatch: what is left is the host time that a
GPU step pays before its kernels can all be queued. Counted alongside: the launches and torch
operations per step (`benchmarks.op_count`), each of which also costs a GPU launch (a few us).

Qwen3-0.6B's depth (28 layers), tiny widths and two heads (the Python per layer does not depend
on them; the CPU's arithmetic does). Two steps:
one decode of a few sequences (what a graph replaces), and the same decodes next to a fresh
1k-token prompt (the serving run's step that carries a new request, eager on any device).

One share of the host time is not the host's on a GPU: the linear layers' matmuls, which this
CPU computes (a 1k-token step's are milliseconds here, a GPU's kernels). `linear_ms` is their
time alone, each of the step's `F.linear` calls timed again on tensors of its shapes (minimum
of a few repeats), so `host_ms_min - linear_ms` bounds what the Python and the other
dispatches take (it also takes out the matmuls' own dispatch, a few us each).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.op_count import OpCounter, interpreter_if_no_gpu

interpreter_if_no_gpu()  # before anything imports `kernels`

SHAPE = dict(hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=32)


def measure(
    layers: int, prompt_len: int, num_decodes: int, repeats: int, dtype: str
) -> dict[str, Any]:
    import torch

    from benchmarks.triton_launches import triton_launch_hook
    from rank_worker.runner.model_runner import ModelRunner, synthetic_plan
    from rank_worker.runner_config import RunnerConfig
    from rank_worker.tp import TPInfo
    from tp_engine.testing import build_random_qwen3

    torch.set_num_threads(1)
    model_dir = build_random_qwen3(
        Path(tempfile.mkdtemp(prefix="eager-host-")) / "m", num_layers=layers,
        max_position_embeddings=prompt_len + 64, seed=0, **SHAPE,
    )  # fmt: skip
    block = 16
    blocks_per_seq = -(-(prompt_len + 8) // block)
    config = RunnerConfig(
        max_model_len=prompt_len + 8, block_size=block, max_num_seqs=num_decodes + 1,
        max_num_batched_tokens=prompt_len + num_decodes,
        num_kv_blocks=(num_decodes + 1) * blocks_per_seq + 1, attention_backend="triton",
        dtype=dtype, enforce_eager=True,
    )  # fmt: skip
    runner = ModelRunner(str(model_dir), config, TPInfo(0, 1), "cpu")
    runner.init_kv_cache(runner.determine_num_kv_blocks())
    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))
              for i in range(num_decodes + 1)]  # fmt: skip
    context = 24
    decodes = [(context, 1, tables[i]) for i in range(num_decodes)]
    plans = {
        "decode": synthetic_plan(decodes),
        "decode+prefill": synthetic_plan([*decodes, (0, prompt_len, tables[-1])]),
    }

    def skip(kernel: Any, args: tuple, kwargs: dict, launch: Any) -> None:
        return None  # the kernel's work is the GPU's; its wrapper's Python has run

    out: dict[str, Any] = {}
    with triton_launch_hook(skip):
        for name, plan in plans.items():
            runner.execute(plan)  # warm-up: first-call allocations and imports
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                runner.execute(plan)
                times.append(time.perf_counter() - start)
            counter = OpCounter()
            with torch.inference_mode(), counter.counting():
                runner.execute(plan)
            launches = sum(1 for _, op, work in counter.ops if work and op.startswith("triton:"))
            out[name] = {
                "host_ms_median": statistics.median(times) * 1e3,
                "host_ms_min": min(times) * 1e3,
                "linear_ms": linear_ms(runner, plan),
                "device_ops": counter.count(),
                "triton_launches": launches,
                "tokens": int(plan.query_start_loc[-1]),
            }
    return out


def linear_ms(runner: Any, plan: Any, repeats: int = 5) -> float:
    """The step's `F.linear` calls alone: recorded during one `execute`, then each timed on
    tensors of its shapes and dtype."""
    import torch
    import torch.nn.functional as F

    shapes: list[tuple[torch.Size, torch.Size, torch.dtype]] = []
    real = F.linear

    def record(x: Any, weight: Any, bias: Any = None) -> Any:
        shapes.append((x.shape, weight.shape, x.dtype))
        return real(x, weight, bias)

    F.linear = record  # the layers look `F.linear` up at each call
    try:
        runner.execute(plan)
    finally:
        F.linear = real
    total = 0.0
    with torch.inference_mode():
        for x_shape, w_shape, dtype in shapes:
            x, w = torch.randn(x_shape, dtype=dtype), torch.randn(w_shape, dtype=dtype)
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                real(x, w)
                best = min(best, time.perf_counter() - start)
            total += best
    return total * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--num-decodes", type=int, default=3)
    p.add_argument("--repeats", type=int, default=15)
    # fp32: a CPU has no fast bf16 matmul, whose cost would hide the host's share.
    p.add_argument("--dtype", default="float32")
    p.add_argument("--output-json", type=Path, required=True)
    args = p.parse_args(argv)
    from benchmarks.results import environment

    steps = measure(args.layers, args.prompt_len, args.num_decodes, args.repeats, args.dtype)
    result = {
        **environment(),
        "benchmark": "eager_step_host",
        "layers": args.layers,
        "shape": SHAPE,
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "num_decodes": args.num_decodes,
        "omp_threads": os.environ.get("OMP_NUM_THREADS"),
        "steps": steps,
    }
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps(result, indent=1) + "\n")
    for name, s in steps.items():
        print(f"{name:>16}: host {s['host_ms_median']:.2f} ms median ({s['host_ms_min']:.2f} "
              f"min), of which {s['linear_ms']:.2f} ms the linears' matmuls; "
              f"{s['device_ops']} device ops ({s['triton_launches']} Triton), "
              f"{s['tokens']} tokens")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
