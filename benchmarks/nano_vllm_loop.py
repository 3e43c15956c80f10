"""nano-vllm's control loop per decode step, without a model: the figure that
`benchmarks/control_plane.py`'s rank-0 cost is compared with.

    python benchmarks/nano_vllm_loop.py --nano-root DIR --num-seqs 64 256 1024 --out result.json

`--nano-root` is a checkout of nano-vllm (github.com/GeeeekExplorer/nano-vllm; nothing is
downloaded here). Its `Scheduler`, `BlockManager` and `Sequence` are pure Python and are imported
from it as they are; only its package `__init__` (which imports the model runner, and with it
flash-attn and CUDA) is skipped, by registering the package without running it. Its `Config`
is skipped too (it reads a checkpoint's config.json): the scheduler reads five fields, given here.

What is timed per step, as `control_plane.py` times ours: `Scheduler.schedule()` (a decode
batch of every running sequence: block appends, and the block hash of each block that fills)
and `Scheduler.postprocess()` with a fixed token per sequence (hash, append, finish checks). Its
equivalent of our plan (`ModelRunner.prepare_decode`: Python lists of every sequence's block
table into tensors) needs CUDA and is not timed, so this is the smaller part of its loop.
Sequences are prefilled first (untimed), with distinct prompts, `ignore_eos`, and room for
every timed step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any


def load_nano(root: Path) -> dict[str, Any]:
    package = types.ModuleType("nanovllm")
    package.__path__ = [str(root / "nanovllm")]  # a package whose __init__ is not run
    sys.modules["nanovllm"] = package
    sys.path.insert(0, str(root))
    from nanovllm.engine.scheduler import Scheduler
    from nanovllm.engine.sequence import Sequence
    from nanovllm.sampling_params import SamplingParams

    return {"Scheduler": Scheduler, "Sequence": Sequence, "SamplingParams": SamplingParams}


def time_decode_steps(
    nano: dict[str, Any], num_seqs: int, prompt_len: int, num_steps: int, block_size: int
) -> dict[str, Any]:
    sequence = nano["Sequence"]
    sequence.block_size = block_size  # a class attribute in nano-vllm
    max_tokens = num_steps + 2
    blocks_per_seq = -(-(prompt_len + max_tokens) // block_size)
    config = types.SimpleNamespace(
        max_num_seqs=num_seqs,
        max_num_batched_tokens=max(num_seqs * prompt_len, prompt_len),
        eos=-1,
        kvcache_block_size=block_size,
        num_kvcache_blocks=num_seqs * blocks_per_seq,
    )
    scheduler = nano["Scheduler"](config)
    params = nano["SamplingParams"](temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_seqs):
        # Distinct prompts: no prefix-cache sharing flatters the step (as control_plane.py).
        tokens = [1 + (i * 7919 + j) % 9973 for j in range(prompt_len)]
        scheduler.add(sequence(tokens, params))
    while scheduler.waiting:  # prefill, untimed
        seqs, is_prefill = scheduler.schedule()
        scheduler.postprocess(seqs, [7] * len(seqs), is_prefill)
    step_us = []
    for _ in range(num_steps):
        start = time.perf_counter()
        seqs, is_prefill = scheduler.schedule()
        scheduler.postprocess(seqs, [7] * len(seqs), is_prefill)
        step_us.append((time.perf_counter() - start) * 1e6)
        assert not is_prefill and len(seqs) == num_seqs
    return {
        "num_seqs": num_seqs,
        "prompt_len": prompt_len,
        "block_size": block_size,
        "num_steps": num_steps,
        "schedule_plus_postprocess_us": {
            "median": statistics.median(step_us),
            "min": min(step_us),
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nano-root", type=Path, required=True, help="a nano-vllm checkout")
    p.add_argument("--num-seqs", type=int, nargs="+", default=[64, 256, 512, 1024])
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--num-steps", type=int, default=50)
    p.add_argument("--block-size", type=int, nargs="+", default=[16, 256])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    nano = load_nano(args.nano_root)
    results = []
    for block_size in args.block_size:
        for n in args.num_seqs:
            r = time_decode_steps(nano, n, args.prompt_len, args.num_steps, block_size)
            results.append(r)
            t = r["schedule_plus_postprocess_us"]
            print(
                f"{n:>6} seqs, block {block_size:>3}: schedule + postprocess "
                f"{t['median']:8.1f} us (min {t['min']:.1f})",
                flush=True,
            )
    args.out.write_text(json.dumps({"command": sys.argv, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
