"""Time a full push of every weight into a running engine, per update path, on CPU over gloo.

    python -m benchmarks.weight_sync --model 0.6B --tp 2 --out benchmarks/results/cpu/weight-sync/0.6B-tp2.json
    python -m benchmarks.weight_sync --model 8B --layers 2 --tp 2 --out .../8B-2layers-tp2.json

Paths: `load_weights` (the caller's full tensors on rank 0, broadcast to the other ranks in
buckets), `update_weights_from_distributed` (a trainer process, rank 0 of a gloo group of
1 + tp, broadcasts each tensor; the engine receives on every rank) and
`update_weights_from_disk` (each rank reads the safetensors files). Weights are random, of the
real Qwen3 shapes (`benchmarks.models`), in bf16; `--layers` keeps only the first layers (the
8B shape does not fit twice, engine plus trainer, in a small machine's memory): the result
says so, and nothing is extrapolated to the whole model.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import time
import traceback
from pathlib import Path
from typing import Any

import torch


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from rank_worker.models.loader import safetensors_files

    out: dict[str, torch.Tensor] = {}
    for path in safetensors_files(ckpt):
        out.update(load_file(str(path)))
    return out


def _trainer(port: int, world: int, ckpt: str, repeats: int, replies: Any) -> None:
    """The trainer: joins the group as rank 0, then broadcasts every tensor `repeats` times."""
    try:
        from rank_worker.control.weight_group import group_broadcast, weights_update_group

        pg, _store = weights_update_group("127.0.0.1", port, 0, world, "bench", "gloo", 600)
        tensors = _tensors(Path(ckpt))
        replies.put(("ready",))
        for _ in range(repeats):
            start = time.perf_counter()
            for t in tensors.values():
                group_broadcast(pg, t)
            replies.put(("sent", time.perf_counter() - start))
    except BaseException:
        replies.put(("error", traceback.format_exc()))


def main() -> None:
    from benchmarks.models import QWEN3_PRESETS
    from benchmarks.results import environment, write_json
    from tp_engine import LLM
    from tp_engine.testing import build_random_qwen3, cached_random_qwen3

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="0.6B", choices=sorted(QWEN3_PRESETS))
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    shape = dict(QWEN3_PRESETS[args.model])
    if args.layers is not None:
        shape["num_layers"] = args.layers
    name = f"weight-sync-{args.model}-{shape['num_layers']}layers-bf16"
    ckpt = cached_random_qwen3(
        name, builder=build_random_qwen3, dtype="bfloat16", tokenizer="qwen3", **shape
    )
    tensors = _tensors(ckpt)
    total_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"{name}: {len(tensors)} tensors, {total_bytes / 2**30:.2f} GiB", flush=True)
    llm = LLM(
        str(ckpt), tensor_parallel_size=args.tp, dtype="bfloat16", num_kv_blocks=16,
        block_size=16, max_model_len=256, max_num_batched_tokens=256,
    )  # fmt: skip
    timings: dict[str, list[float]] = {"load_weights": [], "distributed": [], "disk": []}
    trainer_s: list[float] = []
    try:
        for i in range(args.repeats):
            start = time.perf_counter()
            llm.load_weights(tensors, bucket_bytes=args.bucket_mb << 20, weight_version=f"it{i}")
            timings["load_weights"].append(time.perf_counter() - start)
            print(f"load_weights run {i}: {timings['load_weights'][-1]:.2f} s", flush=True)
        for i in range(args.repeats):
            start = time.perf_counter()
            llm.update_weights_from_disk(str(ckpt))
            timings["disk"].append(time.perf_counter() - start)
            print(f"update_weights_from_disk run {i}: {timings['disk'][-1]:.2f} s", flush=True)

        ctx = mp.get_context("spawn")
        replies = ctx.Queue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        world = 1 + args.tp
        trainer = ctx.Process(
            target=_trainer, args=(port, world, str(ckpt), args.repeats, replies), daemon=True
        )
        trainer.start()
        llm.init_weights_update_group("127.0.0.1", port, 1, world, "bench", timeout_s=600)
        ready = replies.get(timeout=600)
        if ready[0] != "ready":
            raise RuntimeError(ready)
        names = list(tensors)
        dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors.values()]
        shapes = [list(t.shape) for t in tensors.values()]
        for i in range(args.repeats):
            start = time.perf_counter()
            llm.update_weights_from_distributed(names, dtypes, shapes, group_name="bench")
            timings["distributed"].append(time.perf_counter() - start)
            reply = replies.get(timeout=600)
            if reply[0] != "sent":
                raise RuntimeError(reply)
            trainer_s.append(reply[1])
            print(f"update_weights_from_distributed run {i}: {timings['distributed'][-1]:.2f} s "
                  f"(trainer's broadcasts {reply[1]:.2f} s)", flush=True)  # fmt: skip
        llm.destroy_weights_update_group("bench")
        trainer.join(timeout=60)
        # One greedy token, to show the engine still generates after the pushes.
        from tp_engine import SamplingParams

        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1),
                           use_tqdm=False)  # fmt: skip
        print("generates after the updates:", out[0].outputs[0].token_ids, flush=True)
    finally:
        llm.shutdown()
    result = {
        "benchmark": "weight_sync",
        "model_shape": args.model,
        "num_layers": shape["num_layers"],
        "truncated": args.layers is not None,
        "note": (
            f"only the first {shape['num_layers']} layers of the {args.model} shape (real layer, "
            "embedding and head shapes); not extrapolated"
            if args.layers is not None
            else "the whole model"
        ),
        "dtype": "bfloat16",
        "tensor_parallel_size": args.tp,
        "num_tensors": len(tensors),
        "total_bytes": total_bytes,
        "bucket_bytes": args.bucket_mb << 20,
        "seconds": timings,
        "trainer_broadcast_seconds": trainer_s,
        "gib_per_s": {k: [total_bytes / 2**30 / s for s in v] for k, v in timings.items() if v},
        "environment": environment(),
    }
    print(write_json(args.out, result))


if __name__ == "__main__":
    main()
