"""Paged attention kernels against torch SDPA on one GPU: decode GB/s and prefill TFLOP/s.

    python benchmarks/gpu/attention_micro.py --out DIR      # writes DIR/attention_micro.json

One rank of Qwen3-8B (32 query heads over 8 KV heads, head_dim 128, bf16, 16-token pages).

- decode: `kernels.paged_decode_attention` (the triton backend's decode path) over a paged cache
  whose block table is a random permutation, every sequence `context_len` long. Bandwidth bound,
  so the figure is bytes moved / time against the HBM peak, bytes = K and V read
  (2 * B * ctx * kv_heads * head_dim * 2) + query + output (+ block table for ours). Beside it
  SDPA over the same K/V gathered into dense `[B, kv_heads, ctx, head_dim]` tensors.
- prefill: `kernels.paged_prefill_attention` over a prompt whose K/V `kernels.store_kv` wrote
  into the paged cache first, as the backend does; causal FLOPs = 4 * B * H * D * S(S+1)/2
  against the dense bf16 peak. Beside it SDPA with `is_causal=True`.

Each configuration also records ‖ours − sdpa‖ / ‖sdpa‖ (flagged above 2e-2). A configuration
whose tensors would not fit the memory budget is recorded as skipped; one that raises is
recorded with its error and the rest still run. The JSON is rewritten after every
configuration, so a crash leaves what finished. Times are medians of
`triton.testing.do_bench` (L2 flushed before each run) and include each wrapper's host launch
overhead where the GPU does not hide it.

Without CUDA it dry-runs the same code on tiny shapes under Triton's interpreter, timed with
`time.perf_counter`, and marks the JSON `"dry_run": true`: the figures then mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import inspect
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
# Hugging Face's library is also called `kernels`: the repo root must come first.
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

CUDA = torch.cuda.is_available()
# Triton fixes interpreter mode when each `@triton.jit` decorator runs: before `kernels`. A stray
# TRITON_INTERPRET=1 on a GPU machine would time numpy, so it is dropped there.
if CUDA:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = "1"

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import kernels  # noqa: E402
from benchmarks.gpu import prefill_table  # noqa: E402
from kernels._common import num_sms  # noqa: E402
from kernels.decode_attention import (  # noqa: E402
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from kernels.store_kv import store_kv  # noqa: E402

GIB = 1 << 30
REL_ERR_FLAG = 2e-2  # bf16 kernels agree to a few 1e-3; a wrong page, head or mask gives ~1
# (name fragment, HBM bytes/s, dense bf16 FLOP/s); the first fragment in the device name wins.
PEAKS = (
    ("H200", 4.8e12, 989e12),
    ("H100 NVL", 3.9e12, 835e12),
    ("H100 PCIe", 2.0e12, 756e12),
    ("H100", 3.35e12, 989e12),  # SXM: "NVIDIA H100 80GB HBM3"
)
# Slack for do_bench's 256 MiB L2-flush buffer, the caching allocator and the CUDA context.
OVERHEAD_BYTES = GIB


@dataclass(frozen=True)
class Geometry:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def esize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Plan:
    geometry: Geometry
    decode: tuple[tuple[int, int], ...]  # (batch, context_len)
    prefill: tuple[tuple[int, int], ...]  # (batch, prompt_len)


GPU_PLAN = Plan(
    Geometry(32, 8, 128, 16, torch.bfloat16),
    decode=tuple((b, c) for b in (64, 256) for c in (1024, 4096, 16384)),
    prefill=((8, 1024), (1, 4096), (4, 4096), (1, 16384)),
)
QUICK_PLAN = Plan(
    GPU_PLAN.geometry, decode=((64, 4096), (256, 1024)), prefill=((8, 1024), (1, 4096))
)
# Under the interpreter: head_dim 32 still runs tl.dot (K >= 16); 32/64 tokens span 2-4 pages.
DRY_PLAN = Plan(
    Geometry(4, 2, 32, 16, torch.bfloat16),
    decode=((2, 32), (2, 64)),
    prefill=((1, 64), (2, 32)),
)


@dataclass(frozen=True)
class Bench:
    """How this run measures: device, timer, budget, peaks, SDPA options."""

    device: torch.device
    dry_run: bool
    warmup_ms: int
    rep_ms: int
    budget_bytes: int
    peak_bytes_per_s: float
    peak_flops: float
    sdpa_gqa: bool  # enable_gqa accepted; else K/V are repeat_interleave'd before timing
    sdpa_backend: SDPBackend | None  # None: torch's own dispatch

    def time_ms(self, fn: Callable[[], Any]) -> float:
        """Median milliseconds of `fn()` (already run once by the caller, so compiled)."""
        if self.dry_run:
            samples = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(samples)
        params = inspect.signature(triton.testing.do_bench).parameters
        kwargs = {"return_mode": "median"} if "return_mode" in params else {"quantiles": [0.5]}
        ms = triton.testing.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, **kwargs)
        return float(ms[0] if isinstance(ms, (list, tuple)) else ms)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)


def sdpa_supports_gqa() -> bool:
    q = torch.zeros(1, 2, 1, 16)
    kv = torch.zeros(1, 1, 1, 16)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except Exception:  # TypeError before torch 2.5
        return False
    return True


def pick_peaks(name: str, bw_gbs: float | None, tflops: float | None) -> tuple[float, float, str]:
    bw, flops, source = PEAKS[-1][1], PEAKS[-1][2], f"unrecognised {name!r}: assumed H100 SXM"
    for fragment, b, f in PEAKS:
        if fragment in name:
            bw, flops, source = b, f, f"table entry {fragment!r}"
            break
    if bw_gbs is not None:
        bw, source = bw_gbs * 1e9, source + "; bandwidth from --peak-bandwidth-gbs"
    if tflops is not None:
        flops, source = tflops * 1e12, source + "; flops from --peak-tflops"
    return bw, flops, source


def sig(x: float) -> float:
    """Four significant figures: enough for a benchmark, readable in the JSON."""
    return float(f"{x:.4g}")


def error_record(exc: BaseException) -> dict[str, Any]:
    traceback.print_exc()
    return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def measure(
    bench: Bench,
    make_fn: Callable[[], Callable[[], torch.Tensor]],
    figures: Callable[[float], dict],
) -> tuple[dict[str, Any], torch.Tensor | None]:
    """Build the callable, run it once (compile, and the output for the correctness check), time
    it. An exception becomes the record, so one side failing leaves the other's figures."""
    try:
        fn = make_fn()
        out = fn()
        bench.sync()
        ms = bench.time_ms(fn)
    except Exception as exc:
        return error_record(exc), None
    return {"ms": sig(ms), **figures(ms)}, out


def bandwidth_figures(bench: Bench, nbytes: int) -> Callable[[float], dict]:
    def figures(ms: float) -> dict:
        rate = nbytes / (ms * 1e-3)
        return {
            "bytes_moved": nbytes,
            "gb_per_s": sig(rate / 1e9),
            "fraction_of_peak_bandwidth": sig(rate / bench.peak_bytes_per_s),
        }

    return figures


def flop_figures(bench: Bench, flops: int) -> Callable[[float], dict]:
    def figures(ms: float) -> dict:
        rate = flops / (ms * 1e-3)
        return {
            "flops": flops,
            "tflop_per_s": sig(rate / 1e12),
            "fraction_of_peak_flops": sig(rate / bench.peak_flops),
        }

    return figures


def sdpa(
    bench: Bench, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> torch.Tensor:
    """q `[B, H, Sq, D]`, k/v `[B, H_kv, Sk, D]` (`[B, H, Sk, D]` when GQA is unsupported)."""
    kwargs = {"enable_gqa": True} if bench.sdpa_gqa else {}
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, **kwargs)


def sdpa_backend_scope(bench: Bench) -> contextlib.AbstractContextManager:
    """Forces the chosen backend around a whole measurement, so the timed call pays no Python
    context switch of its own."""
    if bench.sdpa_backend is None:
        return contextlib.nullcontext()
    return sdpa_kernel([bench.sdpa_backend])


def sdpa_kv(bench: Bench, g: Geometry, kv: torch.Tensor) -> torch.Tensor:
    """`[B, S, H_kv, D]` storage -> the `[B, H_kv, S, D]` view SDPA takes (last dim dense), or
    without `enable_gqa` a `[B, H, S, D]` copy."""
    kv = kv.transpose(1, 2)
    return kv if bench.sdpa_gqa else kv.repeat_interleave(g.group, dim=1)


def rel_err(
    rec: dict[str, Any], ours: torch.Tensor | None, ref: torch.Tensor | None, against: str = "sdpa"
) -> None:
    if ours is None or ref is None:
        return
    ref32 = ref.float()
    err = ((ours.float() - ref32).norm() / ref32.norm()).item()
    rec["rel_err"] = err if math.isfinite(err) else str(err)  # strict JSON has no NaN
    rec["rel_err_flagged"] = not err <= REL_ERR_FLAG  # NaN is flagged too
    rec["rel_err_against"] = against


def bench_decode(bench: Bench, g: Geometry, batch: int, ctx: int) -> dict[str, Any]:
    es, dev = g.esize, bench.device
    width = ctx // g.block_size  # every sequence exactly ctx long, ctx a multiple of the page
    splits = choose_num_splits(batch, g.num_kv_heads, width * g.block_size, num_sms(dev))
    kv_bytes = 2 * batch * ctx * g.num_kv_heads * g.head_dim * es
    qo_bytes = batch * g.num_heads * g.head_dim * es  # one of q, out
    table_bytes = batch * width * 4
    parts = batch * g.num_heads * splits * (g.head_dim + 1) * 4 if splits > 1 else 0
    ours_need = kv_bytes + 2 * qo_bytes + table_bytes + batch * 4 + parts
    sdpa_need = kv_bytes * (1 if bench.sdpa_gqa else 1 + g.group) + qo_bytes
    rec: dict[str, Any] = {
        "batch": batch,
        "context_len": ctx,
        "num_splits": splits,
        "memory_need_bytes": {"ours": ours_need, "sdpa": sdpa_need},
    }
    if ours_need + OVERHEAD_BYTES > bench.budget_bytes:
        reason = (
            f"skipped: ours needs {ours_need / GIB:.1f} GiB, "
            f"budget {bench.budget_bytes / GIB:.1f} GiB"
        )
        rec["ours"] = rec["sdpa"] = {"skipped": reason}
        return rec

    gen = bench.generator(batch * 100_003 + ctx)
    num_blocks = batch * width
    cache_shape = (num_blocks, g.block_size, g.num_kv_heads, g.head_dim)
    k_cache = torch.randn(cache_shape, dtype=g.dtype, device=dev, generator=gen)
    v_cache = torch.randn(cache_shape, dtype=g.dtype, device=dev, generator=gen)
    # A random permutation: no sequence's pages are contiguous or in order.
    perm = torch.randperm(num_blocks, device=dev, generator=gen)
    block_table = perm.to(torch.int32).view(batch, width).contiguous()  # [B, W]
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)  # [B]
    q = torch.randn(batch, g.num_heads, g.head_dim, dtype=g.dtype, device=dev, generator=gen)
    scale = g.head_dim**-0.5

    rec["ours"], ours_out = measure(
        bench,
        lambda: lambda: paged_decode_attention(q, k_cache, v_cache, seq_lens, block_table, scale),
        bandwidth_figures(bench, kv_bytes + 2 * qo_bytes + table_bytes),
    )
    if ours_need + sdpa_need + OVERHEAD_BYTES > bench.budget_bytes:
        total = (ours_need + sdpa_need) / GIB
        rec["sdpa"] = {
            "skipped": f"skipped: ours + sdpa need {total:.1f} GiB, budget "
            f"{bench.budget_bytes / GIB:.1f} GiB"
        }
        if ours_out is not None:  # still check ours, on a few sequences (the ref loops in Python)
            n = min(batch, 4)
            try:
                ref = paged_decode_attention_ref(
                    q[:n], k_cache, v_cache, seq_lens[:n], block_table[:n], scale
                )
                rel_err(rec, ours_out[:n], ref, f"paged_decode_attention_ref, first {n} sequences")
            except Exception as exc:
                rec["rel_err_error"] = error_record(exc)["error"]
        return rec

    def make_sdpa() -> Callable[[], torch.Tensor]:
        # The same K/V as the pages, gathered per sequence: [B, ctx, H_kv, D].
        idx = block_table.long()
        k_dense = sdpa_kv(bench, g, k_cache[idx].view(batch, ctx, g.num_kv_heads, g.head_dim))
        v_dense = sdpa_kv(bench, g, v_cache[idx].view(batch, ctx, g.num_kv_heads, g.head_dim))
        q4 = q.view(batch, g.num_heads, 1, g.head_dim)  # [B, H, 1, D]
        return lambda: sdpa(bench, q4, k_dense, v_dense, False, scale)

    with sdpa_backend_scope(bench):
        rec["sdpa"], sdpa_out = measure(
            bench, make_sdpa, bandwidth_figures(bench, kv_bytes + 2 * qo_bytes)
        )
    if sdpa_out is not None:
        sdpa_out = sdpa_out.reshape(batch, g.num_heads, g.head_dim)
    rel_err(rec, ours_out, sdpa_out)
    return rec


def bench_prefill(bench: Bench, g: Geometry, batch: int, seq: int) -> dict[str, Any]:
    es, dev = g.esize, bench.device
    tokens = batch * seq
    width = triton.cdiv(seq, g.block_size)
    kv_bytes = 2 * tokens * g.num_kv_heads * g.head_dim * es
    qo_bytes = tokens * g.num_heads * g.head_dim * es
    ours_need = 2 * kv_bytes + 2 * qo_bytes  # the new K/V and the cache holding them
    sdpa_need = qo_bytes + (0 if bench.sdpa_gqa else kv_bytes * g.group)
    flops = 4 * batch * g.num_heads * g.head_dim * seq * (seq + 1) // 2
    rec: dict[str, Any] = {
        "batch": batch,
        "seq_len": seq,
        "memory_need_bytes": {"ours": ours_need, "sdpa": sdpa_need},
    }
    if ours_need + sdpa_need + OVERHEAD_BYTES > bench.budget_bytes:
        reason = f"skipped: needs {(ours_need + sdpa_need) / GIB:.1f} GiB"
        rec["ours"] = rec["sdpa"] = {"skipped": reason}
        return rec

    gen = bench.generator(batch * 100_003 + seq + 1)
    kv_shape = (batch, seq, g.num_kv_heads, g.head_dim)
    k_new = torch.randn(kv_shape, dtype=g.dtype, device=dev, generator=gen)
    v_new = torch.randn(kv_shape, dtype=g.dtype, device=dev, generator=gen)
    q = torch.randn(tokens, g.num_heads, g.head_dim, dtype=g.dtype, device=dev, generator=gen)
    num_blocks = batch * width
    cache_shape = (num_blocks, g.block_size, g.num_kv_heads, g.head_dim)
    # NaN outside the stored slots: a kernel reading a slot it must not shows up as NaN.
    k_cache = torch.full(cache_shape, float("nan"), dtype=g.dtype, device=dev)
    v_cache = torch.full(cache_shape, float("nan"), dtype=g.dtype, device=dev)
    perm = torch.randperm(num_blocks, device=dev, generator=gen)
    block_table = perm.to(torch.int32).view(batch, width).contiguous()  # [B, W]
    pos = torch.arange(seq, device=dev)
    slots = block_table.long()[:, pos // g.block_size] * g.block_size + pos % g.block_size
    store_kv(
        k_new.view(tokens, g.num_kv_heads, g.head_dim),
        v_new.view(tokens, g.num_kv_heads, g.head_dim),
        k_cache,
        v_cache,
        slots.reshape(-1).contiguous(),  # [T] int64
    )
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=dev) * seq  # [B+1]
    seq_lens = torch.full((batch,), seq, dtype=torch.int32, device=dev)  # [B]
    scale = g.head_dim**-0.5

    rec["ours"], ours_out = measure(
        bench,
        lambda: (
            lambda: paged_prefill_attention(
                q, k_cache, v_cache, query_start_loc, seq_lens, block_table, seq, scale
            )
        ),
        flop_figures(bench, flops),
    )
    # The fresh-prompt candidate on the same prompts, from their dense K/V (prefill_table).
    rec["tma"] = prefill_table.time_candidates(
        lambda make_fn, figures: measure(bench, make_fn, figures), flop_figures(bench, flops),
        q, k_new.view(tokens, g.num_kv_heads, g.head_dim),
        v_new.view(tokens, g.num_kv_heads, g.head_dim), query_start_loc, seq, scale, ours_out,
        bench.dry_run,
    )  # fmt: skip

    def make_sdpa() -> Callable[[], torch.Tensor]:
        q4 = q.view(batch, seq, g.num_heads, g.head_dim).transpose(1, 2)  # [B, H, S, D]
        k4, v4 = sdpa_kv(bench, g, k_new), sdpa_kv(bench, g, v_new)
        return lambda: sdpa(bench, q4, k4, v4, True, scale)

    with sdpa_backend_scope(bench):
        rec["sdpa"], sdpa_out = measure(bench, make_sdpa, flop_figures(bench, flops))
    if sdpa_out is not None:
        sdpa_out = sdpa_out.transpose(1, 2).reshape(tokens, g.num_heads, g.head_dim)
    rel_err(rec, ours_out, sdpa_out)
    return rec


def choose_sdpa_backend(bench: Bench, g: Geometry, requested: str) -> tuple[SDPBackend | None, str]:
    """The requested backend if it takes our shapes (decode and causal prefill), else torch's
    own dispatch; the string says which and why."""
    if requested == "default":
        return None, "default dispatch (requested)"
    backend = getattr(SDPBackend, requested.upper())
    probe = dataclasses.replace(bench, sdpa_backend=backend)
    try:
        with sdpa_backend_scope(probe):
            for sq, causal in ((1, False), (32, True)):
                shape = (1, g.num_heads, sq, g.head_dim)
                q = torch.randn(shape, dtype=g.dtype, device=bench.device)
                kv_shape = (1, 32, g.num_kv_heads, g.head_dim)  # [B, S, H_kv, D]
                kv = sdpa_kv(probe, g, torch.randn(kv_shape, dtype=g.dtype, device=bench.device))
                sdpa(probe, q, kv, kv, causal, 1.0)
        bench.sync()
    except Exception as exc:  # "No available kernel": torch's dispatch is the fallback
        return None, f"default dispatch ({requested} refused: {str(exc)[:300]})"
    return backend, requested


def summary(side: dict[str, Any]) -> str:
    if "ms" in side:
        return f"{side['ms']:.3f} ms"
    return side.get("skipped") or side.get("error", "?")


def write(path: Path, result: dict[str, Any]) -> None:
    path.write_text(json.dumps(result, indent=2) + "\n")


def fmt_side(side: dict[str, Any], key: str, frac: str) -> str:
    if "ms" in side:
        return f"{side['ms']:9.3f} {side[key]:9.1f} {100 * side[frac]:6.1f}%"
    return f"{('skipped' if 'skipped' in side else 'ERROR'):>27}"


def fmt_err(rec: dict[str, Any]) -> str:
    err = rec["rel_err"]  # a float, or "nan"/"inf" as a string
    text = f"{err:.2e}" if isinstance(err, float) else str(err)
    return text + (" FLAG" if rec["rel_err_flagged"] else "")


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{result['device']}  dry_run={result['dry_run']}  sdpa={result['sdpa']['backend']}")
    head = f"{'config':<24}{'ours ms':>9} {'rate':>9} {'peak':>7}{'sdpa ms':>9} {'rate':>9} {'peak':>7}  rel err"
    for kind, key, frac, unit in (
        ("decode", "gb_per_s", "fraction_of_peak_bandwidth", "GB/s"),
        ("prefill", "tflop_per_s", "fraction_of_peak_flops", "TFLOP/s"),
    ):
        print(f"\n{kind} (rate in {unit})\n{head}")
        for rec in result[kind]:
            if kind == "decode":
                name = f"B={rec['batch']} ctx={rec['context_len']}"
            else:
                name = f"B={rec['batch']} S={rec['seq_len']}"
            if "error" in rec:
                print(f"{name:<24}ERROR {rec['error'][:80]}")
                continue
            err = rec.get("rel_err")
            err_s = "-" if err is None else fmt_err(rec)
            ours, sd = fmt_side(rec["ours"], key, frac), fmt_side(rec["sdpa"], key, frac)
            print(f"{name:<24}{ours}{sd}  {err_s}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="directory for attention_micro.json")
    p.add_argument("--quick", action="store_true", help="4 configurations instead of 10 (GPU)")
    p.add_argument("--peak-bandwidth-gbs", type=float, default=None)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--mem-budget-gib", type=float, default=60.0)
    p.add_argument(
        "--prefill-table", type=Path, default=None,
        help="write the chosen prefill table here (kernels/tuned/prefill_tiles.json is read)",
    )  # fmt: skip
    p.add_argument("--warmup-ms", type=int, default=25)
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument(
        "--sdpa-backend",
        choices=("flash_attention", "cudnn_attention", "efficient_attention", "math", "default"),
        default="flash_attention",
        help="SDPA backend to force (falls back to torch's dispatch if it refuses our shapes)",
    )
    args = p.parse_args()

    kernels_dir = Path(kernels.__file__).resolve().parent
    if kernels_dir != REPO_ROOT / "kernels":
        raise SystemExit(f"`import kernels` found {kernels_dir}, not this repo's package")
    dry_run = not CUDA
    plan = DRY_PLAN if dry_run else (QUICK_PLAN if args.quick else GPU_PLAN)
    g = plan.geometry
    device = torch.device("cuda", torch.cuda.current_device()) if CUDA else torch.device("cpu")
    name = torch.cuda.get_device_name(device) if CUDA else "cpu (Triton interpreter)"
    budget = int(args.mem_budget_gib * GIB)
    if CUDA:
        free, _ = torch.cuda.mem_get_info(device)
        budget = min(budget, free)
    bw, flops, peak_source = pick_peaks(name, args.peak_bandwidth_gbs, args.peak_tflops)
    gqa = sdpa_supports_gqa()
    bench = Bench(device, dry_run, args.warmup_ms, args.rep_ms, budget, bw, flops, gqa, None)
    torch.manual_seed(0)
    backend, backend_note = choose_sdpa_backend(bench, g, args.sdpa_backend)
    bench = dataclasses.replace(bench, sdpa_backend=backend)

    try:
        from benchmarks.results import environment

        env: dict[str, Any] = environment()
    except Exception as exc:  # the benchmark does not need the rest of the project
        env = {"error": f"benchmarks.results.environment(): {exc!r}"}
    result: dict[str, Any] = {
        "benchmark": "attention_micro",
        "dry_run": dry_run,
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "environment": env,
        "peaks": {"bandwidth_bytes_per_s": bw, "bf16_dense_flops": flops, "source": peak_source},
        "geometry": {
            "num_heads": g.num_heads,
            "num_kv_heads": g.num_kv_heads,
            "head_dim": g.head_dim,
            "block_size": g.block_size,
            "dtype": str(g.dtype).removeprefix("torch."),
        },
        "memory_budget_bytes": budget,
        "timing": (
            {"method": "time.perf_counter, median of 3 (dry run: meaningless)"}
            if dry_run
            else {
                "method": "triton.testing.do_bench median (L2 flushed per run)",
                "warmup_ms": args.warmup_ms,
                "rep_ms": args.rep_ms,
            }
        ),
        "kernels": {
            "decode": "kernels.decode_attention.paged_decode_attention",
            "prefill": "kernels.prefill_attention.paged_prefill_attention "
            "(cache filled by kernels.store_kv.store_kv, untimed)",
            "prefill_tma": "kernels.prefill_attention_tma.fresh_prefill_attention per tile of "
            "benchmarks/gpu/prefill_table.py (the prompt's dense K/V), rel_err_vs_paged",
        },
        "sdpa": {
            "backend": backend_note,
            "gqa": "enable_gqa=True"
            if gqa
            else "repeat_interleave of K/V before timing (enable_gqa unsupported)",
            "decode_layout": "q [B, H, 1, D]; k/v [B, H_kv, ctx, D] views (last dim dense) of "
            "[B, ctx, H_kv, D] tensors gathered from the pages before timing",
            "prefill_layout": "q [B, H, S, D], k/v [B, H_kv, S, D] views of [B, S, H(_kv), D] "
            "tensors, is_causal=True",
        },
        "formulas": {
            "decode_bytes": "2 * B * ctx * kv_heads * head_dim * 2 + q + out "
            "(+ block table for ours)",
            "prefill_flops": "4 * B * H * D * S * (S + 1) / 2",
            "rel_err": f"||ours - sdpa|| / ||sdpa||, flagged above {REL_ERR_FLAG}",
        },
        "decode": [],
        "prefill": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "attention_micro.json"
    t_start = time.perf_counter()
    jobs = [("decode", bench_decode, c) for c in plan.decode]
    jobs += [("prefill", bench_prefill, c) for c in plan.prefill]
    for kind, fn, (batch, length) in jobs:
        t0 = time.perf_counter()
        try:
            rec = fn(bench, g, batch, length)
        except Exception as exc:
            rec = {"batch": batch, "context_len" if kind == "decode" else "seq_len": length}
            rec.update(error_record(exc))
        rec["wall_s"] = round(time.perf_counter() - t0, 2)
        result[kind].append(rec)
        status = rec.get("error") or {side: summary(rec[side]) for side in ("ours", "sdpa")}
        err = f" rel_err={fmt_err(rec)}" if "rel_err" in rec else ""
        print(
            f"[{time.perf_counter() - t_start:6.1f}s] {kind} B={batch} len={length}: {status}{err}"
        )
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()
        write(path, result)
    result["wall_s"] = round(time.perf_counter() - t_start, 2)
    capability = list(torch.cuda.get_device_capability(device)) if CUDA else [0, 0]
    table = prefill_table.build_table(result["prefill"], g.dtype, g.head_dim, capability, name)
    result["prefill_table"] = table
    if args.prefill_table is not None:
        args.prefill_table.parent.mkdir(parents=True, exist_ok=True)
        args.prefill_table.write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {args.prefill_table}: {table['entries']}")
    write(path, result)
    print_table(result)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
