"""The control plane's CPU cost per decode step, without a model, for any version of the engine.

    python benchmarks/control_plane.py --root DIR --num-seqs 64 256 --out result.json

Imports the engine from `--root` (a checkout: this one, or a worktree of an older commit, so
that before and after are measured by the same code in the same run; `launch/
bench_control_plane.py` does exactly that) and measures, per step, medians over the timed
steps:

- rank 0: `schedule`, `plan` (building the StepPlan), `encode` (into a ring-slot-sized
  buffer), `update` (applying the sampled tokens);
- a worker: `decode` (StepPlan.decode from the bytes) and `inputs` (`prepare_inputs` into the
  runner's persistent CPU buffers: what a rank does on the host before its forward pass).

Sequences are prefilled first (untimed), then every timed step is a pure decode batch of all
running sequences; the "sampler" is a fixed token, so only the control plane is measured. It
also records the plan's encoded size per decode step.

Self-contained on purpose: it must run against older checkouts, so it imports nothing from this
repository but the engine packages under `--root`, and it adapts to the two plan protocols
(whole block tables per plan; table edits since control plane v2).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any


def load_engine(root: Path) -> dict[str, Any]:
    sys.path.insert(0, str(root))
    import numpy as np
    import torch

    from rank_worker.inputs import input_prep
    from rank_worker.runner_config import RunnerConfig
    from shm_ipc.step_plan import StepPlan
    from tp_engine.config import EngineConfig
    from tp_engine.sampling_params import SamplingParams

    try:  # the engine core's package (tp_engine/core/, since the restructuring of issue 45)
        from tp_engine.core import scheduler as scheduler_mod
        from tp_engine.core.kv.block_manager import BlockManager
        from tp_engine.core.plan_builder import build_step_plan
        from tp_engine.core.sequence import Sequence
    except ImportError:  # an older checkout: the control plane's modules side by side
        from tp_engine import scheduler as scheduler_mod  # type: ignore[no-redef]
        from tp_engine.block_manager import BlockManager  # type: ignore[no-redef]
        from tp_engine.plan_builder import build_step_plan  # type: ignore[no-redef]
        from tp_engine.sequence import Sequence  # type: ignore[no-redef]

    torch.set_num_threads(1)
    return dict(
        np=np, input_prep=input_prep, RunnerConfig=RunnerConfig, StepPlan=StepPlan,
        Scheduler=scheduler_mod.Scheduler, BlockManager=BlockManager,
        EngineConfig=EngineConfig, build_step_plan=build_step_plan,
        SamplingParams=SamplingParams, Sequence=Sequence,
        v2=hasattr(scheduler_mod, "ScheduledStep"),
    )  # fmt: skip


def time_decode_steps(
    e: dict[str, Any], num_seqs: int, prompt_len: int, num_steps: int, block_size: int
) -> dict[str, Any]:
    np = e["np"]
    budget = max(8192, num_seqs)
    # Room for the timed steps and for the tokens sampled while the later prompts prefill
    # (every running sequence decodes one token a step meanwhile; with long prompts that is a
    # thousand steps), so that no sequence ends before the timed steps are over.
    prefill_steps = -(-num_seqs * prompt_len // (budget // 2))
    max_tokens = 2 * num_steps + 8 + prefill_steps
    max_model_len = prompt_len + max_tokens
    blocks_per_seq = -(-max_model_len // block_size)
    config = e["EngineConfig"](
        max_model_len=max_model_len,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=budget,
        block_size=block_size,
        num_kv_blocks=num_seqs * blocks_per_seq,
    )
    bm = e["BlockManager"](num_seqs * blocks_per_seq, block_size, True)
    sched = e["Scheduler"](config, bm, eos_token_ids=[0])
    params = e["SamplingParams"](max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    for i in range(num_seqs):
        # Distinct prompts: no prefix-cache sharing flatters the update step.
        tokens = [1 + (i * 7919 + j) % 9973 for j in range(prompt_len)]
        sched.add(e["Sequence"](f"r{i}", tokens, params))

    runner_config = e["RunnerConfig"](
        max_model_len=max_model_len, block_size=block_size, max_num_seqs=num_seqs,
        max_num_batched_tokens=budget, num_kv_blocks=1,
    )  # fmt: skip
    prep = e["input_prep"]
    buffers = prep.StepInputBuffers.for_config(runner_config, "cpu")
    if e["v2"]:
        from rank_worker.inputs.block_tables import BlockTables
        from shm_ipc.step_plan import batch_rows

        tables = BlockTables(batch_rows(num_seqs), blocks_per_seq, block_size, "cpu")

        def build(out: Any, step_id: int) -> Any:
            return e["build_step_plan"](out, step_id)

        def inputs(plan: Any) -> Any:
            return prep.prepare_inputs(plan, tables, buffers=buffers)

        def update(out: Any) -> None:
            sched.update(out, np.ones(out.num_samples, dtype=np.int64))
    else:

        def build(out: Any, step_id: int) -> Any:
            return e["build_step_plan"](out, block_size, step_id)

        def inputs(plan: Any) -> Any:
            return prep.prepare_inputs(plan, "cpu", buffers=buffers)

        def update(out: Any) -> None:
            sched.update(out, [1] * out.num_samples)

    slot = bytearray(1 << 24)
    step_id = 0

    def step() -> tuple[list[float], int, Any]:
        nonlocal step_id
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        plan = build(out, step_id)
        t2 = time.perf_counter()
        n = plan.encode_into(memoryview(slot))
        t3 = time.perf_counter()
        received = e["StepPlan"].decode(memoryview(slot)[:n])
        t4 = time.perf_counter()
        inputs(received)
        t5 = time.perf_counter()
        update(out)
        t6 = time.perf_counter()
        step_id += 1
        return [t1 - t0, t2 - t1, t3 - t2, t6 - t5, t4 - t3, t5 - t4], n, out

    # Prefill everything (untimed; the worker side replays every plan) until all decode.
    while any(sched.batch.is_prefill(s.row) for s in sched.running) or sched.waiting:
        step()
    times, sizes = [], []
    for _ in range(num_steps):
        t, n, out = step()
        if out.num_batched_tokens != num_seqs:
            raise RuntimeError(f"step {step_id} was not a full decode batch of {num_seqs}")
        times.append(t)
        sizes.append(n)
    us = np.asarray(times) * 1e6  # [steps, phases]
    names = ["schedule", "plan", "encode", "update", "decode", "inputs"]
    med = {name: float(np.median(us[:, i])) for i, name in enumerate(names)}
    rank0 = us[:, :4].sum(axis=1)
    worker = us[:, 4:].sum(axis=1)
    return {
        "num_seqs": num_seqs,
        "prompt_len": prompt_len,
        "num_steps": num_steps,
        "block_size": block_size,
        "median_us": med,
        "rank0_us": {"median": float(np.median(rank0)), "p99": float(np.percentile(rank0, 99))},
        "worker_us": {"median": float(np.median(worker)), "p99": float(np.percentile(worker, 99))},
        # Mean over the timed steps: with a multiple of block_size steps every sequence gets
        # the same number of new blocks in them, whatever its context length.
        "plan_bytes": {
            "median": float(np.median(sizes)),
            "mean": float(np.mean(sizes)),
            "max": int(max(sizes)),
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--root", type=Path, required=True, help="checkout whose engine is measured")
    p.add_argument("--num-seqs", type=int, nargs="+", default=[64, 256, 512, 1024])
    p.add_argument("--prompt-len", type=int, nargs="+", default=[256])
    p.add_argument("--num-steps", type=int, default=50)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    engine = load_engine(args.root.resolve())
    rows = []
    for prompt_len in args.prompt_len:
        for n in args.num_seqs:
            r = time_decode_steps(engine, n, prompt_len, args.num_steps, args.block_size)
            rows.append(r)
            m = r["median_us"]
            print(
                f"{n:>6} seqs x {prompt_len:>6} tokens: rank 0 {r['rank0_us']['median']:8.1f} us "
                f"(schedule {m['schedule']:.1f}, plan {m['plan']:.1f}, encode {m['encode']:.1f}, "
                f"update {m['update']:.1f}), worker {r['worker_us']['median']:8.1f} us, "
                f"plan {r['plan_bytes']['median']:.0f} B (mean {r['plan_bytes']['mean']:.0f}, "
                f"max {r['plan_bytes']['max']})",
                flush=True,
            )
    args.out.write_text(
        json.dumps({"root": str(args.root), "v2": engine["v2"], "results": rows}, indent=2) + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
