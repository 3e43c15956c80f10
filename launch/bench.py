"""Offline throughput against the physical limit, on nano-vllm's workload by default.

    python launch/bench.py --model 0.6B                        # random-weight Qwen3-0.6B shape
    python launch/bench.py --model /path/to/Qwen3-8B --tensor-parallel-size 2
    torchrun --nproc-per-node 4 launch/bench.py --model 32B    # the multi-GPU benchmark
    python launch/bench.py --num-seqs 8 --max-input-len 64 --max-output-len 32   # demo model, CPU

Default workload (nano-vllm's `bench.py`): 256 sequences, `random.seed(0)`, prompt and output
lengths uniform in [100, 1024], token ids uniform in [0, 10000], ignore_eos: 133,966 output
tokens. One short untimed warm-up request runs first. The limit model is
`benchmarks.limits`; the peaks are the GPU's data-sheet figures (H200: 989 TFLOP/s bf16,
4.8 TB/s) or `--peak-tflops` / `--peak-bandwidth-gbs`; on a CPU, without those flags, nominal
placeholders are used and the result file says so. Under torchrun only rank 0 reports.

The result file also records the engine's start-up (`startup_s`): the whole `LLM(...)` call and
rank 0's phases in it (load: weights; profile: the memory warm-up; kv_cache; kernel_warmup: the
first launch, on a GPU the compile, of every Triton kernel; capture: the decode CUDA graphs,
with the batch sizes captured).

`--step-timeline PATH` records rank 0's per-step phases (`tp_engine.common.step_timeline`) during the
timed run and writes them, with their per-phase summary and this run's metadata, to PATH; the
summary also goes into the result file. Draw it with `python launch/plot.py timeline PATH`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# The benchmark harness (`benchmarks/`) lives in the checkout, not in the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.limits import ModelShape, Peaks, offline_limit, peaks_for
from benchmarks.models import read_hf_config, resolve_model
from benchmarks.results import environment, write_json
from benchmarks.triton_launches import compiled_binaries
from benchmarks.workload import NANO_VLLM_OUTPUT_TOKENS, random_workload, repetition_workload
from tp_engine import LLM, SamplingParams
from tp_engine.common.step_timeline import StepTimeline
from tp_engine.config.flags import add_engine_flags, engine_kwargs
from tp_engine.config.help_format import HelpFormatter

# `--seed` is the workload's here (nano-vllm's); the engine keeps its default seed.
ENGINE_FLAGS_SPELT_HERE = ("seed",)
_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint dir or Qwen3 size (0.6B .. 32B, 30B-A3B, 235B-A22B); default demo",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=None,
        help="ranks (default: torchrun's WORLD_SIZE, else 1)",
    )
    p.add_argument(
        "--dist-backend",
        choices=["nccl", "gloo"],
        default=None,
        help="collectives between ranks (default: nccl with GPUs, gloo on CPU)",
    )
    p.add_argument("--num-seqs", type=int, default=256, help="requests in the workload")
    p.add_argument("--min-input-len", type=int, default=100, help="shortest random prompt")
    p.add_argument("--max-input-len", type=int, default=1024, help="longest random prompt")
    p.add_argument("--min-output-len", type=int, default=100, help="fewest tokens to generate")
    p.add_argument("--max-output-len", type=int, default=1024, help="most tokens to generate")
    p.add_argument("--seed", type=int, default=0, help="workload seed (nano-vllm: 0)")
    # The engine's flags: the one table every script reads (`tp_engine.config.flags`).
    add_engine_flags(p, exclude=ENGINE_FLAGS_SPELT_HERE)
    p.add_argument(
        "--workload",
        choices=["random", "repetition"],
        default="random",
        help="random: nano-vllm's; repetition: each prompt a passage repeated --copies times "
        "(--num-seqs prompts of --passage-len tokens, --max-output-len tokens each)",
    )
    p.add_argument("--passage-len", type=int, default=64, help="repetition: tokens per passage")
    p.add_argument("--copies", type=int, default=3, help="repetition: passages per prompt")
    p.add_argument(
        "--temperature", type=float, default=0.6, help="sampling temperature (0: greedy)"
    )
    p.add_argument(
        "--peak-tflops", type=float, default=None, help="peak dense FLOP/s per device, in TFLOP/s"
    )
    p.add_argument(
        "--peak-bandwidth-gbs", type=float, default=None, help="peak memory B/s per device, in GB/s"
    )
    p.add_argument(
        "--output-json",
        default=None,
        help="default benchmarks/results/bench-<model>-tp<N>-<time>.json",
    )
    p.add_argument(
        "--step-timeline",
        type=Path,
        default=None,
        metavar="PATH",
        help="record rank 0's step phases during the timed run and write them to PATH (JSON)",
    )
    return p.parse_args(argv)


def _bytes_per_value(dtype: str, hf_config: dict) -> int:
    if dtype == "auto":
        import torch

        # The engine's "auto": the checkpoint's dtype on GPU, float32 on CPU.
        dtype = (
            str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32")
            if torch.cuda.is_available()
            else "float32"
        )
    return _BYTES[dtype.removeprefix("torch.")]


def _linear_bytes_per_value(hf_config: dict) -> float | None:
    """An FP8 checkpoint's linear weights: 1 byte each plus a 4-byte scale per 128×128 block;
    None for an unquantized one (the model dtype's bytes)."""
    if (hf_config.get("quantization_config") or {}).get("quant_method") != "fp8":
        return None
    return 1 + 4 / (128 * 128)


def startup_record(llm: LLM, total_s: float) -> dict:
    """How long the engine took to start, by phase (rank 0's), and what it captured."""
    runner = llm.engine.runner
    graphs, mixed = runner.graph_runner, runner.mixed_graphs
    captured = sorted(graphs.graphs) if graphs is not None else []  # (q tokens per seq, size)
    return {
        "total": total_s,
        **runner.startup_s,
        "cuda_graph_sizes": [s for q, s in captured if q == 1],
        # With speculative decoding, those of verify steps (q = 1 + k).
        "cuda_verify_graph_sizes": [s for q, s in captured if q > 1],
        "static_block_table_width": graphs.buffers.width if graphs is not None else None,
        # Mixed steps (prompt tokens), by token bucket; the device bytes every graph took.
        "cuda_mixed_graph_tokens": sorted(mixed.graphs) if mixed is not None else [],
        "cuda_graph_memory_bytes": runner.graph_memory_bytes,
        "num_kv_blocks": runner.num_kv_blocks,
    }


def speculative_record(llm: LLM) -> dict:
    """Drafts proposed and accepted over the run (the warm-up request's included), and the mean
    acceptance length: tokens per verify step of a sequence, 1 + accepted / drafts (vLLM's)."""
    values = {m.name: getattr(m, "value", getattr(m, "values", None)) for m in llm.get_metrics()}
    drafts = values["vllm:spec_decode_num_drafts"]
    accepted = values["vllm:spec_decode_num_accepted_tokens"]
    return {
        "num_drafts": drafts,
        "num_draft_tokens": values["vllm:spec_decode_num_draft_tokens"],
        "num_accepted_tokens": accepted,
        "accepted_per_position": values["vllm:spec_decode_num_accepted_tokens_per_pos"],
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
    }


def runner_phases(startup: dict) -> dict[str, float]:
    return {
        k: startup[k]
        for k in ("load", "profile", "kv_cache", "kernel_warmup", "capture")
        if k in startup
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = resolve_model(args.model)
    hf_config = read_hf_config(model_dir)
    if args.workload == "repetition":
        workload = repetition_workload(
            args.num_seqs, args.passage_len, args.copies, args.max_output_len,
            vocab_size=hf_config["vocab_size"], seed=args.seed,
        )  # fmt: skip
    else:
        workload = random_workload(
            args.num_seqs,
            args.min_input_len,
            args.max_input_len,
            args.min_output_len,
            args.max_output_len,
            vocab_size=hf_config["vocab_size"],
            seed=args.seed,
        )
    startup_start = time.perf_counter()
    llm = LLM(
        str(model_dir),
        tensor_parallel_size=args.tensor_parallel_size,
        dist_backend=args.dist_backend,
        **engine_kwargs(args, exclude=ENGINE_FLAGS_SPELT_HERE),
    )  # ranks other than 0 serve inside this call and exit
    startup = startup_record(llm, time.perf_counter() - startup_start)
    binaries_after_startup = compiled_binaries()
    env = environment()
    tp_size = llm.engine.tp.size
    is_default = args.workload == "random" and (
        args.num_seqs, args.min_input_len, args.max_input_len, args.min_output_len,
        args.max_output_len, args.seed,
    ) == (256, 100, 1024, 100, 1024, 0)  # fmt: skip
    if is_default and workload.num_output_tokens != NANO_VLLM_OUTPUT_TOKENS:
        raise RuntimeError(f"workload drifted: {workload.num_output_tokens} output tokens")
    params = [
        SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n)
        for n in workload.output_lens
    ]
    timeline: StepTimeline | None = None
    timeline_dict: dict | None = None
    timeline_summary: dict | None = None
    try:
        llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        if args.step_timeline:
            # After the warm-up, so that it holds the timed run's steps only. Only rank 0 gets
            # here (the other ranks served inside LLM()), so only rank 0 records.
            timeline = llm.engine.timeline = StepTimeline()
        start = time.perf_counter()
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in workload.prompt_token_ids],
            params,
            use_tqdm=sys.stderr.isatty(),
        )
        elapsed = time.perf_counter() - start
        if timeline is not None:
            llm.engine.timeline = None
            # Before shutdown: resolving device phases needs the CUDA context and streams.
            timeline_dict, timeline_summary = timeline.to_dict(), timeline.summary()
        spec = speculative_record(llm) if args.speculative_config else None
    finally:
        llm.shutdown()
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    if generated != workload.num_output_tokens:
        raise RuntimeError(
            f"generated {generated} tokens, the workload asks {workload.num_output_tokens}"
        )

    if args.peak_tflops is not None or args.peak_bandwidth_gbs is not None:
        default = peaks_for(env["device"])
        peaks = Peaks(
            args.peak_tflops * 1e12 if args.peak_tflops else default.flops_per_s,
            args.peak_bandwidth_gbs * 1e9 if args.peak_bandwidth_gbs else default.bytes_per_s,
            "command-line flags",
        )
    else:
        peaks = peaks_for(env["device"])
    limit = offline_limit(
        ModelShape.from_hf_config(hf_config),
        workload.prompt_lens,
        workload.output_lens,
        max_num_seqs=args.max_num_seqs,
        bytes_per_value=_bytes_per_value(args.dtype, hf_config),
        peaks=peaks,
        tp_size=tp_size,
        linear_bytes_per_value=_linear_bytes_per_value(hf_config),
        kv_bytes_per_value=1 if args.kv_cache_dtype == "fp8" else None,
    )
    throughput = generated / elapsed
    fraction = limit.time_s / elapsed
    metadata = {
        **env,
        "model": args.model or "demo",
        "model_dir": str(model_dir),
        "tensor_parallel_size": tp_size,
        "workload": {
            "num_seqs": workload.num_seqs,
            "input_len": [args.min_input_len, args.max_input_len],
            "output_len": [args.min_output_len, args.max_output_len],
            "seed": args.seed,
            "nano_vllm_default": is_default,
            "prompt_tokens": workload.num_prompt_tokens,
            "output_tokens": workload.num_output_tokens,
        },
        "engine_args": {
            k: v
            for k, v in vars(args).items()
            if k not in ("model", "output_json", "step_timeline")
        },
        "elapsed_s": elapsed,
        "startup_s": startup,
        # Triton binaries per kernel (GPU; the interpreter compiles none): a difference between
        # the two means serving compiled new variants mid-run.
        "triton_binaries": {
            "after_startup": binaries_after_startup,
            "after_run": compiled_binaries(),
        },
        # What the engine resolved "auto" knobs to.
        "async_scheduling": llm.engine.async_scheduling,
    }
    result = {
        "benchmark": "offline",
        **metadata,
        "output_tokens_per_s": throughput,
        "total_tokens_per_s": (generated + workload.num_prompt_tokens) / elapsed,
        "peaks": {
            "flops_per_s": peaks.flops_per_s,
            "bytes_per_s": peaks.bytes_per_s,
            "source": peaks.source,
        },
        "limit": limit.as_dict(),
        "limit_output_tokens_per_s": generated / limit.time_s,
        "fraction_of_limit": fraction,
    }
    if spec is not None:
        result["speculative"] = spec
    name = (args.model or "demo").rstrip("/").rsplit("/", 1)[-1]
    path = args.output_json or (
        Path("benchmarks/results")
        / f"bench-{name}-tp{tp_size}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    if timeline_dict is not None:
        result["step_timeline"] = str(args.step_timeline)
        result["step_timeline_summary"] = timeline_summary
        write_json(
            args.step_timeline,
            {
                "benchmark": "step_timeline",
                "result_json": str(path),
                **metadata,
                "clock": "rank 0 time.perf_counter() seconds since the timeline was attached",
                "summary": timeline_summary,
                **timeline_dict,
            },
        )
    write_json(path, result)
    print(
        f"Total: {generated} output tokens ({workload.num_prompt_tokens} prompt) in {elapsed:.2f} s, "
        f"{throughput:.2f} tok/s\n"
        f"Limit: {limit.time_s:.4f} s ({generated / limit.time_s:.2f} tok/s; prefill "
        f"{limit.prefill_time_s:.4f} s + {limit.num_decode_steps} decode steps "
        f"{limit.decode_time_s:.4f} s) at {peaks.flops_per_s / 1e12:g} TFLOP/s, "
        f"{peaks.bytes_per_s / 1e9:g} GB/s per device [{peaks.source}]\n"
        f"Fraction of limit: {fraction:.4f}\n"
        f"Start-up: {startup['total']:.2f} s ("
        + ", ".join(f"{k} {v:.2f} s" for k, v in runner_phases(startup).items())
        + ")\n"
        f"Result: {path}"
        + (f"\nStep timeline: {args.step_timeline}" if timeline_dict is not None else "")
        + (
            f"\nSpeculative: {spec['num_accepted_tokens']} of {spec['num_draft_tokens']} draft "
            f"tokens accepted, mean acceptance length {spec['mean_acceptance_length']}"
            if spec is not None
            else ""
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
