"""Decode attention's tile choice, swept: the step's largest cost at 256 sequences.

    python benchmarks/gpu/decode_tiles.py --out DIR      # writes DIR/decode_tiles.json

`kernels.decode_attention.launch_meta` picks stage 1's key tile, warps and pipeline stages once
per geometry. This times `paged_decode_attention` with each candidate patched in (the first is
the shipped choice), on Qwen3-0.6B's attention (16 query heads over 8 KV heads, head_dim 128,
bf16, 16-token pages in random order), and checks every candidate's output against the shipped
one's. A candidate that beats the shipped tile everywhere is what `launch_meta` should pick.

Without a GPU it runs two candidates on a tiny batch under the interpreter (figures meaningless).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import triton  # noqa: E402

import kernels.decode_attention as decode  # noqa: E402
from benchmarks.limits import peaks_for  # noqa: E402
from benchmarks.results import environment  # noqa: E402

CUDA = torch.cuda.is_available()
# (BLOCK_N, num_warps, num_stages); the first is what launch_meta ships for bf16, head_dim 128
# (since the H200 run of 2026-11-27; the 64-key tile before it is the second).
CANDIDATES = [(128, 8, 3), (64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 3), (32, 4, 4), (128, 8, 2)]
# (batch, context): the profile's 256 x ~1k, the serving mix, one long sequence (split-KV).
SHAPES = [(256, 1024), (256, 4096), (64, 4096), (1, 16384)]


def with_tile(block_n: int, num_warps: int, num_stages: int):
    shipped = decode.launch_meta

    def patched(*args, **kwargs):
        meta = shipped(*args, **kwargs)
        return {**meta, "BLOCK_N": block_n, "num_warps": num_warps, "num_stages": num_stages}

    return patched


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    dev = torch.device("cuda" if CUDA else "cpu")
    heads, kv_heads, head_dim, page = 16, 8, 128, 16
    shapes, candidates = (SHAPES, CANDIDATES) if CUDA else ([(2, 64)], CANDIDATES[:2])
    if not CUDA:
        heads, kv_heads, head_dim = 4, 2, 32
    name = torch.cuda.get_device_name(dev) if CUDA else "cpu (Triton interpreter)"
    peak_bw = peaks_for(name).bytes_per_s if CUDA else None
    shipped_meta = decode.launch_meta
    result = {"benchmark": "decode_tiles", "device": name, "environment": environment(),
              "geometry": dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                               block_size=page, dtype="bfloat16"),
              "peak_bandwidth_bytes_per_s": peak_bw,
              "timing": "triton.testing.do_bench median, L2 flushed" if CUDA else "one call",
              "candidates": [list(c) for c in candidates], "rows": []}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device=dev).manual_seed(0)
    for batch, ctx in shapes:
        width = ctx // page
        shape = (batch * width, page, kv_heads, head_dim)
        k = torch.randn(shape, dtype=torch.bfloat16, device=dev, generator=g)
        v = torch.randn(shape, dtype=torch.bfloat16, device=dev, generator=g)
        perm = torch.randperm(batch * width, device=dev, generator=g)
        table = perm.to(torch.int32).view(batch, width).contiguous()
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device=dev, generator=g)
        nbytes = 2 * k.numel() * k.element_size() + 2 * q.numel() * q.element_size()
        baseline = None
        for cand in candidates:
            decode.launch_meta = with_tile(*cand)
            try:
                fn = functools.partial(
                    decode.paged_decode_attention, q, k, v, lens, table, head_dim**-0.5
                )
                out = fn()
                if baseline is None:
                    baseline = out.float()
                err = ((out.float() - baseline).norm() / baseline.norm()).item()
                if CUDA:
                    ms = float(
                        triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                    )
                else:
                    t0 = time.perf_counter()
                    fn()
                    ms = (time.perf_counter() - t0) * 1e3
                row = dict(batch=batch, context_len=ctx, tile=list(cand), ms=round(ms, 4),
                           gb_per_s=round(nbytes / ms / 1e6, 1), rel_err_vs_shipped=err)  # fmt: skip
                if peak_bw:
                    row["fraction_of_peak_bandwidth"] = round(nbytes / (ms * 1e-3) / peak_bw, 4)
            except Exception as exc:  # a tile that does not compile (registers, shared memory)
                row = dict(batch=batch, context_len=ctx, tile=list(cand), error=repr(exc)[:300])
            finally:
                decode.launch_meta = shipped_meta
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            (args.out / "decode_tiles.json").write_text(json.dumps(result, indent=1))
        if CUDA:
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
