"""Decode attention's kernel and tile, swept: writes the decode table the runtime reads.

    python benchmarks/gpu/decode_tiles.py --out DIR [--table kernels/tuned/decode_tiles.json]

Times `paged_decode_attention` with each candidate (kernel, block_n, num_warps, num_stages)
passed as its `tile`, for 1, 8, 64 and 256 sequences x 1k, 4k and 16k tokens of context, over a
bf16 and an fp8 (e4m3) KV cache, on Qwen3-0.6B's attention (16 query heads over 8 KV heads,
head_dim 128, bf16 queries, 16-token pages in random order), and checks every candidate's
output against the first (today's default) one's. `DIR/decode_tiles.json` gets every row;
`--table` gets, per (batch, context, KV dtype), the fastest candidate whose output agrees: the
table `kernels.attention_tables` reads (`kernels/tuned/decode_tiles.json` is where the runtime
looks; `run.sh lease` writes it there and beside the results).

Timing is `triton.testing.do_bench`'s median with L2 flushed. `--budget-s` bounds the sweep: a
shape not reached gets no entry (its bucket keeps the default tile) and the JSON says so.

Without a GPU (`--dry-run`, or no CUDA) it runs the same code under the interpreter on tiny
shapes (batch 1 and 2, contexts 32 and 64, two candidates) and writes a table with capability
[0, 0], which no GPU matches: the figures mean nothing, the code path is what it checks.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

CUDA = torch.cuda.is_available() and "--dry-run" not in sys.argv
if CUDA:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = "1"  # before `kernels` is imported

import triton  # noqa: E402
import triton.testing  # noqa: E402

from kernels._common import FP8_KV_DTYPE, FP8_KV_MAX  # noqa: E402
from kernels.attention_tables import Tile, parse_table  # noqa: E402
from kernels.decode_attention import paged_decode_attention  # noqa: E402

# (kernel, block_n, num_warps, num_stages); the first is today's default for bf16 at head_dim
# 128 (the split kernel's (128, 8, 3)), the baseline every other output is checked against.
# Split: the 2026-11-27 sweep's best two and its runners-up. Packed: 128 (key, head) rows = 16
# keys of all 8 heads, the same K/V tile bytes as the split kernel's 128 keys, and around it.
CANDIDATES = [
    ("split", 128, 8, 3),
    ("split", 128, 4, 3),
    ("split", 64, 4, 3),
    ("split", 128, 8, 2),
    ("packed", 128, 8, 3),
    ("packed", 128, 4, 3),
    ("packed", 64, 4, 3),
    ("packed", 256, 8, 3),
    ("packed", 256, 8, 2),
]
BATCHES = [1, 8, 64, 256]
CONTEXTS = [1024, 4096, 16384]
KV_DTYPES = {"bfloat16": torch.bfloat16, "fp8": FP8_KV_DTYPE}
GEOMETRY = dict(num_heads=16, num_kv_heads=8, head_dim=128, block_size=16)
# Dry run: the interpreter's own default tiles (None: the kernel's default under interpretation).
DRY_CANDIDATES = [("split", None, None, None), ("packed", None, None, None)]
DRY_GEOMETRY = dict(num_heads=4, num_kv_heads=2, head_dim=32, block_size=16)
# bf16 outputs of two summation orders agree to a few 1e-3; a wrong page or head gives ~1.
REL_ERR_MAX = 2e-2


def make_inputs(batch, ctx, kv_dtype, geometry, device, gen):
    """A paged cache of `batch` sequences of `ctx` tokens, pages in random order."""
    page, kv_heads, head_dim = (
        geometry["block_size"],
        geometry["num_kv_heads"],
        geometry["head_dim"],
    )
    width = triton.cdiv(ctx, page)
    shape = (batch * width, page, kv_heads, head_dim)
    scales = torch.tensor([0.02, 0.02], device=device)
    caches = []
    for _ in range(2):
        x = torch.randn(shape, dtype=torch.bfloat16, device=device, generator=gen)
        if kv_dtype == FP8_KV_DTYPE:
            x = x.mul_(1 / 0.02).clamp_(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)
        caches.append(x)
    perm = torch.randperm(batch * width, device=device, generator=gen)
    table = perm.to(torch.int32).view(batch, width).contiguous()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(
        batch, geometry["num_heads"], head_dim, dtype=torch.bfloat16, device=device, generator=gen
    )
    return q, caches[0], caches[1], lens, table, (scales if kv_dtype == FP8_KV_DTYPE else None)


def time_ms(fn) -> float:
    if CUDA:
        return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def sweep_shape(inputs, candidates, scale: float) -> list[dict]:
    """Each candidate on one shape: its time and its output's distance from the first's."""
    q, k, v, lens, table, scales = inputs
    kv_bytes = 2 * k.numel() * k.element_size()
    rows, baseline = [], None
    for cand in candidates:
        tile = Tile(cand[0], None, *cand[1:])
        fn = functools.partial(
            paged_decode_attention, q, k, v, lens, table, scale, kv_scales=scales, tile=tile
        )
        row: dict = dict(candidate=list(cand))
        try:
            out = fn().float()
            baseline = out if baseline is None else baseline
            err = ((out - baseline).norm() / baseline.norm()).item()
            ms = time_ms(fn)
            row.update(ms=round(ms, 4), gb_per_s=round(kv_bytes / ms / 1e6, 1),
                       rel_err_vs_first=err)  # fmt: skip
        except Exception as exc:  # a tile that does not compile (registers, shared memory)
            row["error"] = repr(exc)[:300]
        rows.append(row)
    return rows


def best_entries(rows: list[dict]) -> list[dict]:
    """Per (batch, context, kv_dtype): the fastest row that ran and agreed with the baseline."""
    best: dict[tuple, dict] = {}
    for row in rows:
        if "ms" not in row or not row["rel_err_vs_first"] <= REL_ERR_MAX:
            continue
        key = (row["batch"], row["context_len"], row["kv_dtype"])
        if key not in best or row["ms"] < best[key]["ms"]:
            best[key] = row
    entries = []
    for (batch, ctx, kv), row in sorted(best.items()):
        kernel, block_n, warps, stages = row["candidate"]
        entry = dict(batch=batch, context=ctx, kv_dtype=kv, kernel=kernel, block_n=block_n,
                     num_warps=warps, num_stages=stages, ms=row["ms"])  # fmt: skip
        if block_n is None:  # dry run: the interpreter's defaults, written out for the parser
            entry.update(block_n=16 if kernel == "split" else 32, num_warps=4, num_stages=1)
        entries.append(entry)
    return entries


def make_table(rows, batches, contexts, head_dim, capability, device_name) -> dict:
    table = {
        "table": "decode_tiles",
        "version": 1,
        "device": device_name,
        "capability": capability,
        "head_dim": head_dim,
        "source": "benchmarks/gpu/decode_tiles.py: the fastest agreeing candidate per shape",
        "batch_buckets": batches,
        "context_buckets": contexts,
        "entries": best_entries(rows),
    }
    parse_table(
        table, "<the sweep's table>", "decode_tiles"
    )  # never write what the runtime refuses
    return table


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="directory for decode_tiles.json")
    p.add_argument("--table", type=Path, default=None, help="where to write the chosen table")
    p.add_argument("--budget-s", type=float, default=240.0)
    p.add_argument("--dry-run", action="store_true", help="the interpreter on tiny shapes")
    args = p.parse_args()
    dev = torch.device("cuda" if CUDA else "cpu")
    if CUDA:
        geometry, candidates, batches, contexts = GEOMETRY, CANDIDATES, BATCHES, CONTEXTS
        name = torch.cuda.get_device_name(dev)
        capability = list(torch.cuda.get_device_capability(dev))
    else:
        geometry, candidates, batches, contexts = DRY_GEOMETRY, DRY_CANDIDATES, [1, 2], [32, 64]
        name, capability = "cpu (Triton interpreter)", [0, 0]
    result = {"benchmark": "decode_tiles", "device": name, "dry_run": not CUDA,
              "geometry": dict(geometry, q_dtype="bfloat16"),
              "timing": "triton.testing.do_bench median, L2 flushed" if CUDA else "one call",
              "candidates": [list(c) for c in candidates], "rows": [], "not_reached": []}  # fmt: skip
    try:
        from benchmarks.results import environment

        result["environment"] = environment()
    except Exception as exc:  # the sweep does not need the rest of the project
        result["environment"] = {"error": repr(exc)}
    args.out.mkdir(parents=True, exist_ok=True)
    out_json = args.out / "decode_tiles.json"
    gen = torch.Generator(device=dev).manual_seed(0)
    scale = geometry["head_dim"] ** -0.5
    t_start = time.perf_counter()
    # Large batches first: the 256-sequence step is the one the issue is about, and a budget
    # that runs out should cut the shapes that matter least.
    for batch in sorted(batches, reverse=True):
        for ctx in contexts:
            for kv_name, kv_dtype in KV_DTYPES.items():
                if time.perf_counter() - t_start > args.budget_s:
                    result["not_reached"].append([batch, ctx, kv_name])
                    continue
                inputs = make_inputs(batch, ctx, kv_dtype, geometry, dev, gen)
                for row in sweep_shape(inputs, candidates, scale):
                    row = dict(batch=batch, context_len=ctx, kv_dtype=kv_name, **row)
                    result["rows"].append(row)
                    print(json.dumps(row), flush=True)
                del inputs
                if CUDA:
                    torch.cuda.empty_cache()
                out_json.write_text(json.dumps(result, indent=1))
    chosen = make_table(
        result["rows"], batches, contexts, geometry["head_dim"], capability, name
    )  # fmt: skip
    result["table"] = chosen
    out_json.write_text(json.dumps(result, indent=1))
    if args.table is not None:
        args.table.parent.mkdir(parents=True, exist_ok=True)
        args.table.write_text(json.dumps(chosen, indent=1) + "\n")
        print(f"wrote {args.table}: {len(chosen['entries'])} entries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
