"""The fresh-prompt prefill candidates of `attention_micro.py`, and the prefill table it writes.

For each prefill configuration `attention_micro.py` times the paged kernel (`ours`); this times
`kernels.prefill_attention_tma.fresh_prefill_attention` with each candidate tile on the same
prompt (its dense K/V, as the backend hands them over) and checks it against the paged kernel's
output. `build_table` then picks, per prompt length, the kernel whose total time over that
length's configurations is lowest (the paged kernel's own tile is recorded in its entries but not
applied: only the TMA kernel's tile is tuned). The table is what `kernels.attention_tables` reads
from `kernels/tuned/prefill_tiles.json`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kernels.attention_tables import Tile, kv_dtype_name, parse_table
from kernels.prefill_attention_tma import fresh_prefill_attention

# (block_m, block_n, num_warps, num_stages, warp_specialize); the first is the kernel's default
# on sm_90 at head_dim 128. Shared memory of each (Q + stages x (K + V) tiles) fits sm_90's
# 227 KiB; tests/test_kernels_compile.py compiles whatever the table ends up naming.
TMA_CANDIDATES = [
    (128, 64, 8, 3, False),
    (128, 64, 8, 3, True),
    (128, 128, 8, 2, False),
    (128, 128, 8, 2, True),
    (64, 64, 4, 3, False),
    (128, 32, 4, 4, False),
]
DRY_TMA_CANDIDATES = [(None, None, None, None, None)]  # the interpreter's defaults
# What `prefill_attention.launch_meta` launches at head_dim 128 in 16 bits (rows = block_m).
PAGED_TILE = dict(block_m=128, block_n=64, num_warps=8, num_stages=3, warp_specialize=False)
REL_ERR_MAX = 2e-2


def time_candidates(
    measure: Callable, figures: Callable, q, k_new, v_new, query_start_loc, seq, scale, ours, dry
) -> list[dict[str, Any]]:
    """`measure(make_fn, figures) -> (record, out)` from attention_micro, per candidate tile.
    q `[T, H, D]`, k_new/v_new `[T, KV, D]`; `ours`: the paged kernel's output (or None)."""
    records = []
    for cand in DRY_TMA_CANDIDATES if dry else TMA_CANDIDATES:
        tile = Tile("tma", *cand)

        def make_fn(tile=tile):
            return lambda: fresh_prefill_attention(
                q, k_new, v_new, query_start_loc, seq, scale, tile=tile
            )

        rec, out = measure(make_fn, figures)
        rec["tile"] = list(cand)
        if out is not None and ours is not None:
            ref = ours.float()
            rec["rel_err_vs_paged"] = ((out.float() - ref).norm() / ref.norm()).item()
        records.append(rec)
    return records


def build_table(
    prefill: list[dict], dtype: torch.dtype, head_dim: int, capability: list[int], device: str
) -> dict[str, Any]:
    """Per prompt length: the kernel (paged, or the TMA kernel with one of its tiles) with the
    lowest total time over the configurations of that length that every candidate ran."""
    totals: dict[int, dict[tuple, float]] = {}
    for rec in prefill:
        if "ms" not in rec.get("ours", {}):
            continue
        options = {("paged",): rec["ours"]["ms"]}
        for tma in rec.get("tma", []):
            if "ms" in tma and tma.get("rel_err_vs_paged", 1.0) <= REL_ERR_MAX:
                options[("tma", *tma["tile"])] = tma["ms"]
        length_totals = totals.setdefault(rec["seq_len"], {})
        for key, ms in options.items():
            length_totals[key] = length_totals.get(key, 0.0) + ms
    entries = []
    for length, options in sorted(totals.items()):
        best, ms = min(options.items(), key=lambda kv: kv[1])
        if best[0] == "paged":
            entry = dict(kernel="paged", **PAGED_TILE)
        else:
            block_m, block_n, warps, stages, ws = best[1:]
            if block_m is None:  # dry run: the interpreter's defaults, written out
                block_m, block_n, warps, stages, ws = 16, 16, 4, 1, False
            entry = dict(kernel="tma", block_m=block_m, block_n=block_n, num_warps=warps,
                         num_stages=stages, warp_specialize=ws)  # fmt: skip
        entries.append(dict(length=length, dtype=kv_dtype_name(dtype), **entry, ms=round(ms, 4)))
    table = {
        "table": "prefill_tiles",
        "version": 1,
        "device": device,
        "capability": capability,
        "head_dim": head_dim,
        "source": "benchmarks/gpu/attention_micro.py: the fastest kernel per prompt length",
        "length_buckets": sorted(totals) or [1],
        "entries": entries,
    }
    parse_table(table, "<attention_micro's table>", "prefill_tiles")
    return table
