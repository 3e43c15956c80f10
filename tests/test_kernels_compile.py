"""Every kernel compiles for an H100/H200 (sm_90), on any machine.

The interpreter runs the kernels' arithmetic but not Triton's GPU compiler, which rejects
things the interpreter accepts (a `tl.dot` under 16 rows, a constexpr of the wrong type, more
shared memory than the SM has). This test compiles, ahead of time and without a GPU, what the
wrappers would launch (`launch_meta` is the wrappers' own choice of constexprs) for
representative geometries, down to SASS with the ptxas that ships with Triton, so a CPU-only
CI catches a kernel that would not build on the target.

It runs in a subprocess because this process imported the kernels under TRITON_INTERPRET=1
(tests/conftest.py), which makes them interpreter objects the compiler cannot take.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# Hopper's largest shared-memory allocation per block (227 KiB).
SM90_MAX_SHARED_BYTES = 232448

# Pointer arguments that are not of the tensor dtype under test.
_INDEX_PTRS = {
    "query_start_loc_ptr",
    "seq_lens_ptr",
    "block_table_ptr",
    "slot_mapping_ptr",
    "positions_ptr",
    "sorted_ids_ptr",
    "block_expert_ptr",
}
_FP32_PTRS = {"part_out_ptr", "part_lse_ptr", "cos_sin_ptr", "topk_weights_ptr"}


def _unspecialised(fn) -> set[str]:
    """Arguments the kernel excludes from specialisation (its `do_not_specialize*` lists, which
    some Triton versions keep as indices)."""
    out = set()
    for attr in ("do_not_specialize", "do_not_specialize_on_alignment"):
        for item in getattr(fn, attr, None) or ():
            out.add(fn.arg_names[item] if isinstance(item, int) else item)
    return out


def _compile(fn, dtype: str, consts: dict, ptr_types: dict[str, str] | None = None) -> int:
    """Compile `fn` for sm_90 with `consts`; returns its shared memory in bytes (see `_build`)."""
    return int(_build(fn, dtype, consts, ptr_types).metadata.shared)


def _build(fn, dtype: str, consts: dict, ptr_types: dict[str, str] | None = None):
    """Compile `fn` for sm_90 with `consts`; returns the compiled kernel. Pointers are of
    `dtype` unless `ptr_types` (name -> Triton type, e.g. "fp8e4nv", "i64") or the index and
    fp32 sets above say otherwise."""
    ptr_types = ptr_types or {}
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options = {k: consts.pop(k) for k in ("num_warps", "num_stages") if k in consts}
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            continue
        if name in ptr_types:  # a tensor descriptor's type is no pointer
            ty = ptr_types[name]
            signature[name] = ty if ty.startswith("tensordesc") else "*" + ty
        elif name.endswith("_ptr"):
            ty = "i32" if name in _INDEX_PTRS else "fp32" if name in _FP32_PTRS else dtype
            signature[name] = "*" + ty
        else:
            signature[name] = "fp32" if name in ("qk_scale", "eps") else "i32"
        # What the JIT specializes on for real shapes: 16-byte aligned pointers and strides that
        # are multiples of 16, except what the kernel excludes from specialisation (values that
        # change from step to step, such as the block table's width).
        excluded = _unspecialised(fn)
        if name not in excluded and (name.endswith("_ptr") or name.startswith("stride")):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _compile_tma(fn, dtype: str, meta: dict) -> int:
    """Compile the TMA prefill kernel: its Q/K/V arguments are host-side tensor descriptors,
    typed by their blocks (BLOCK_M or BLOCK_N rows of HEAD_DIM)."""
    rows = {"desc_q": meta["BLOCK_M"], "desc_k": meta["BLOCK_N"], "desc_v": meta["BLOCK_N"]}
    types = {k: f"tensordesc<{dtype}[{r}, {meta['HEAD_DIM']}]>" for k, r in rows.items()}
    return _compile(fn, dtype, dict(meta), types)


def table_tiles_report(torch_dtype: dict) -> dict[str, int]:
    """Every tile the committed tables (`kernels/tuned/`) name, compiled as the wrappers launch
    it for the table's own head_dim and Qwen3-0.6B's groups of 2 (keys `table-...`): a lease's
    sweep rewrites the tables, and what it wrote must still build here."""

    from kernels import (
        attention_tables as at,
    )
    from kernels import (
        decode_attention,
        decode_attention_packed,
        prefill_attention_tma,
    )

    report = {}
    table = at.load_table(at.TUNED_DIR / at.DECODE_FILE, "decode_tiles")
    for (batch, context, kv), tile in (table.entries if table else {}).items():
        module = decode_attention_packed if tile.kernel == "packed" else decode_attention
        kernel = getattr(
            module, "_decode_packed_kernel" if tile.kernel == "packed" else "_decode_split_kernel"
        )
        tile_args = (tile.block_n, tile.num_warps, tile.num_stages)
        dt = {"bfloat16": "bf16", "float16": "fp16", "fp8": "bf16"}[kv]  # fp8: bf16 queries
        meta = module.launch_meta(2, 16, table.head_dim, 16, torch_dtype[dt], False, *tile_args)
        types = (
            {"k_cache_ptr": "fp8e4nv", "v_cache_ptr": "fp8e4nv", "kv_scale_ptr": "fp32"}
            if kv == "fp8"
            else None
        )
        name = f"table-decode-{batch}x{context}-{kv}-{tile.kernel}"
        report[name] = _compile(kernel, dt, dict(meta, KV_FP8=kv == "fp8"), types)
    table = at.load_table(at.TUNED_DIR / at.PREFILL_FILE, "prefill_tiles")
    for (length, dtype), tile in (table.entries if table else {}).items():
        dt = {"bfloat16": "bf16", "float16": "fp16"}[dtype]
        tile_args = (tile.block_m, tile.block_n, tile.num_warps, tile.num_stages)
        name = f"table-prefill-{length}-{dtype}-{tile.kernel}"
        if tile.kernel == "tma":
            meta = prefill_attention_tma.launch_meta(
                2, table.head_dim, torch_dtype[dt], False, *tile_args, tile.warp_specialize
            )
            report[name] = _compile_tma(prefill_attention_tma._fresh_prefill_kernel, dt, meta)
    return report


def compile_report() -> dict[str, int]:
    """Name -> shared bytes for every kernel in representative geometries (run in a child)."""
    import importlib

    import torch
    import triton

    from kernels import (
        activation,
        decode_attention,
        decode_attention_packed,
        fp8_gemm,
        lora,
        lora_grouped,
        prefill_attention,
        prefill_attention_tma,
        rmsnorm,
        rotary,
    )

    # `kernels.store_kv` the attribute is the re-exported function; the module is in sys.modules.
    store_kv = importlib.import_module("kernels.store_kv")
    qk_norm_rope = importlib.import_module("kernels.qk_norm_rope")
    fused_moe = importlib.import_module("kernels.fused_moe")
    gumbel = importlib.import_module("kernels.gumbel_sample")

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    report = {}
    # (dtype, head_dim, group, block_size): Qwen3's head_dim 128 with groups of 8 and 5, a plain
    # MHA, the fp32 path and a wide head.
    for dt, head_dim, group, block_size in [
        ("bf16", 128, 8, 16),
        ("fp16", 64, 1, 256),
        ("fp32", 128, 5, 16),
        ("bf16", 256, 2, 32),
    ]:
        meta = prefill_attention.launch_meta(
            group, head_dim, block_size, torch_dtype[dt], interpret=False
        )
        name = f"prefill-{dt}-d{head_dim}-g{group}-bs{block_size}"
        report[name] = _compile(
            prefill_attention._prefill_attention_kernel, dt, dict(meta, KV_FP8=False)
        )
        # One binary for any split count (a runtime value, see kernels.decode_attention).
        meta = decode_attention.launch_meta(
            group, 8 * group, head_dim, block_size, torch_dtype[dt], interpret=False
        )
        name = f"decode-{dt}-d{head_dim}-g{group}-bs{block_size}"
        report[name] = _compile(decode_attention._decode_split_kernel, dt, dict(meta, KV_FP8=False))
    # The fp8 KV cache (e4m3 pages, bf16 queries) in both attention kernels.
    fp8_kv = {"k_cache_ptr": "fp8e4nv", "v_cache_ptr": "fp8e4nv", "kv_scale_ptr": "fp32"}
    meta = decode_attention.launch_meta(8, 64, 128, 16, torch.bfloat16, interpret=False)
    report["decode-bf16-kvfp8"] = _compile(
        decode_attention._decode_split_kernel, "bf16", dict(meta, KV_FP8=True), fp8_kv
    )
    meta = prefill_attention.launch_meta(8, 128, 16, torch.bfloat16, interpret=False)
    report["prefill-bf16-kvfp8"] = _compile(
        prefill_attention._prefill_attention_kernel, "bf16", dict(meta, KV_FP8=True), fp8_kv
    )
    # The packed decode kernel (several KV heads per program, kernels.decode_attention_packed):
    # Qwen3-0.6B's 8 KV heads of 2 in one program, groups of 8 and 5, fp32, an fp8 cache.
    for dt, group in (("bf16", 2), ("bf16", 8), ("bf16", 5), ("fp32", 4)):
        meta = decode_attention_packed.launch_meta(
            group, 8 * group, 128, 16, torch_dtype[dt], interpret=False
        )
        report[f"decode_packed-{dt}-g{group}"] = _compile(
            decode_attention_packed._decode_packed_kernel, dt, dict(meta, KV_FP8=False)
        )
    meta = decode_attention_packed.launch_meta(2, 16, 128, 16, torch.bfloat16, interpret=False)
    report["decode_packed-bf16-kvfp8"] = _compile(
        decode_attention_packed._decode_packed_kernel, "bf16", dict(meta, KV_FP8=True), fp8_kv
    )
    # The fresh-prompt TMA prefill (kernels.prefill_attention_tma): Qwen3's head_dim 128 with
    # groups of 8 (with and without warp specialization), fp16 at 64, the fp32 path.
    for dt, head_dim, group, ws in (
        ("bf16", 128, 8, False),
        ("bf16", 128, 8, True),
        ("fp16", 64, 1, False),
        ("fp32", 128, 4, False),
    ):
        meta = prefill_attention_tma.launch_meta(
            group, head_dim, torch_dtype[dt], False, warp_specialize=ws
        )
        name = f"prefill_tma-{dt}-d{head_dim}-g{group}-ws{ws}"
        report[name] = _compile_tma(prefill_attention_tma._fresh_prefill_kernel, dt, meta)
    report.update(table_tiles_report(torch_dtype))
    merge = dict(
        NUM_HEADS=64,
        SPLITS_PAD=triton.next_power_of_2(decode_attention.MAX_SPLITS),
        HEAD_DIM=128,
        BLOCK_D=128,
    )
    report["decode-merge"] = _compile(decode_attention._decode_merge_kernel, "bf16", merge)
    report["store_kv"] = _compile(store_kv._store_kv_kernel, "bf16", dict(ROW=1024, BLOCK=1024))
    for n, add in ((5120, True), (128, False)):
        consts = dict(N=n, BLOCK_N=8192 if n > 4096 else n, ADD_RESIDUAL=add)
        consts["ROWS"] = max(1, min(16, 4096 // consts["BLOCK_N"]))
        report[f"rmsnorm-{n}-add{add}"] = _compile(rmsnorm._rms_norm_kernel, "bf16", consts)
    rope = dict(NUM_Q_HEADS=40, NUM_K_HEADS=8, BLOCK_Q_HEADS=64, BLOCK_K_HEADS=8, HALF=64)
    rope["BLOCK_HALF"] = 64
    report["rotary"] = _compile(rotary._rotary_kernel, "bf16", rope)
    silu = dict(INTER=17408, BLOCK=1024)
    report["silu_and_mul"] = _compile(activation._silu_and_mul_kernel, "bf16", silu)
    # Qwen3-32B's q/k heads on one rank (64 + 8 of 128 dims), and a small fp32 test geometry.
    for dt, heads, kv_heads, head_dim in (("bf16", 64, 8, 128), ("fp32", 4, 2, 16)):
        meta = qk_norm_rope.launch_meta(heads, kv_heads, head_dim)
        name = f"qk_norm_rope-{dt}-h{heads}-kv{kv_heads}-d{head_dim}"
        report[name] = _compile(qk_norm_rope._qk_norm_rope_kernel, dt, meta)
    # The same with the K/V store fused in (Qwen3-0.6B's 16 + 8 heads): into a cache of the
    # model dtype, and into an fp8 cache (its pointers e4m3, the scales fp32).
    fp8_cache = {"k_cache_ptr": "fp8e4nv", "v_cache_ptr": "fp8e4nv", "kv_scale_ptr": "fp32"}
    for kv_fp8 in (False, True):
        meta = qk_norm_rope.launch_meta(16, 8, 128, store_kv=True, kv_fp8=kv_fp8)
        types = fp8_cache if kv_fp8 else {"kv_scale_ptr": "fp32"}
        name = f"qk_norm_rope_store_kv-bf16-kvfp8{kv_fp8}"
        report[name] = _compile(qk_norm_rope._qk_norm_rope_kernel, "bf16", meta, types)
    # Qwen3-30B-A3B's experts whole (TP = 1 or expert parallel), Qwen3-235B-A22B's sliced over
    # 8 ranks, and a tiny fp32 test geometry; top 8 of 128 (2 of 8 for the tiny one).
    for dt, hidden, inter, top_k in (("bf16", 2048, 768, 8), ("bf16", 4096, 192, 8),
                                     ("fp32", 32, 16, 2)):  # fmt: skip
        meta = fused_moe.launch_meta(torch_dtype[dt], interpret=False)
        gate_up = dict(meta, HIDDEN=hidden, INTER=inter, TOP_K=top_k)
        name = f"moe_gate_up-{dt}-h{hidden}-i{inter}"
        report[name] = _compile(fused_moe._moe_gate_up_kernel, dt, gate_up)
        down = dict(meta, HIDDEN=hidden, INTER=inter)
        report[f"moe_down-{dt}-h{hidden}-i{inter}"] = _compile(fused_moe._moe_down_kernel, dt, down)
    # FP8 experts (e4m3 weights and activations with fp32 group scales) under bf16 and fp32
    # models: the dot's K takes e4m3 operands, which need K >= 32 on sm_90.
    for dt in ("bf16", "fp32"):
        meta = dict(fused_moe.launch_meta(torch_dtype[dt], interpret=False, fp8=True), FP8=True)
        e4m3 = {
            "x_ptr": "fp8e4nv",
            "w13_ptr": "fp8e4nv",
            "x_scale_ptr": "fp32",
            "w_scale_ptr": "fp32",
        }
        gate_up = dict(meta, HIDDEN=2048, INTER=768, TOP_K=8)
        report[f"moe_gate_up-fp8-{dt}"] = _compile(fused_moe._moe_gate_up_kernel, dt, gate_up, e4m3)
        e4m3 = {
            "act_ptr": "fp8e4nv",
            "w2_ptr": "fp8e4nv",
            "act_scale_ptr": "fp32",
            "w_scale_ptr": "fp32",
        }
        down = dict(meta, HIDDEN=2048, INTER=768)
        report[f"moe_down-fp8-{dt}"] = _compile(fused_moe._moe_down_kernel, dt, down, e4m3)
    # FP8 linear layers: activation quantization (from bf16 and fp32) and the W8A8 GEMM.
    for dt in ("bf16", "fp32"):
        quant = dict(K=4096, GROUP_SIZE=128, FP8_MAX_VALUE=448.0, MIN_SCALE=1e-10,
                     INTERPRETED=False, num_warps=1)  # fmt: skip
        types = {"q_ptr": "fp8e4nv", "s_ptr": "fp32"}
        kernel = _build(fp8_gemm._token_group_quant_kernel, dt, quant, types)
        report[f"fp8_quant-{dt}"] = int(kernel.metadata.shared)
        # Quantization must divide as torch does (IEEE, round to nearest): `/` in Triton is an
        # approximate division on a GPU, which the interpreter cannot show.
        ptx = kernel.asm["ptx"]
        report[f"approximate-divisions-fp8_quant-{dt}"] = ptx.count("div.full") + ptx.count(
            "div.approx"
        )
    gemm = dict(fp8_gemm.launch_meta(interpret=False), N=4096, K=4096, GROUP_SIZE=128)
    types = {"xq_ptr": "fp8e4nv", "w_ptr": "fp8e4nv", "xs_ptr": "fp32", "ws_ptr": "fp32"}
    report["w8a8_gemm"] = _compile(fp8_gemm._w8a8_block_matmul_kernel, "bf16", gemm, types)
    # One-pass sampling over fp32 logits, each row in slices (its constants are globals the
    # JIT must accept): the min-p maxima, the slices' samples with and without min-p, the merge.
    i64 = dict.fromkeys(["out_ptr", "rows_ptr", "seeds_ptr", "counters_ptr", "part_id_ptr"], "i64")
    block = dict(BLOCK=gumbel._BLOCK)
    report["gumbel_split_max"] = _compile(gumbel._split_max_kernel, "fp32", dict(block), i64)
    for min_p in (False, True):
        consts = dict(block, MIN_P=min_p, SPLITS_PAD=gumbel._SPLITS_PAD)
        name = f"gumbel_split_sample-minp{min_p}"
        report[name] = _compile(gumbel._split_sample_kernel, "fp32", consts, i64)
    merge = dict(SPLITS_PAD=gumbel._SPLITS_PAD)
    report["gumbel_split_merge"] = _compile(gumbel._split_merge_kernel, "fp32", merge, i64)
    # Multi-LoRA shrink and expand, per token and grouped: rank 16 (bf16, fp32) and the largest
    # rank, 512.
    lora_types = {"h_ptr": "fp32", "slots_ptr": "i32", "offsets_ptr": "i32"}
    for dt, rank in (("bf16", 16), ("fp32", 16), ("bf16", 512)):
        block_r, block = triton.next_power_of_2(rank), lora._block(rank)
        shrink = dict(P=3, R=rank, BLOCK_R=block_r, BLOCK_K=block)
        report[f"lora_shrink-{dt}-r{rank}"] = _compile(lora._shrink_kernel, dt, shrink, lora_types)
        expand = dict(P=3, R=rank, BLOCK_R=block_r, BLOCK_N=block)
        report[f"lora_expand-{dt}-r{rank}"] = _compile(lora._expand_kernel, dt, expand, lora_types)
        # The grouped (SGMV) forms, with their tl.dot tiles.
        grouped_types = dict(lora_types, order_ptr="i32", starts_ptr="i32")
        for kernel in (lora_grouped._grouped_shrink_kernel, lora_grouped._grouped_expand_kernel):
            meta = dict(lora_grouped.grouped_meta(kernel, torch_dtype[dt], rank), P=3, R=rank)
            name = f"lora_{kernel.fn.__name__.strip('_')}-{dt}-r{rank}"
            report[name] = _compile(kernel, dt, meta, grouped_types)
    return report


def test_every_kernel_compiles_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]);"
        "from tests.test_kernels_compile import compile_report;"
        "print('REPORT ' + json.dumps(compile_report()))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(REPO_ROOT)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("REPORT "))
    report = json.loads(line.removeprefix("REPORT "))
    approx = {k: report.pop(k) for k in list(report) if k.startswith("approximate-divisions")}
    tables = {k: report.pop(k) for k in list(report) if k.startswith("table-")}
    too_big = {k: v for k, v in tables.items() if v > SM90_MAX_SHARED_BYTES}
    assert not too_big, f"a table's tile needs more shared memory than sm_90 has: {too_big}"
    assert len(approx) == 2 and not any(approx.values()), approx
    too_big = {k: v for k, v in report.items() if v > SM90_MAX_SHARED_BYTES}
    assert not too_big, f"more shared memory than an sm_90 block can have: {too_big}"
    # 4 prefill, 4 decode, merge, store_kv, 2 rmsnorm, rotary, silu, 2 qk_norm_rope, 3 x 2 MoE;
    # 2 with an fp8 KV cache, 2 x 2 fp8 MoE, 2 fp8 quant, the W8A8 GEMM, 4 of Gumbel sampling,
    # 3 x 4 of LoRA; 5 of the packed decode kernel, 4 of the TMA prefill; 2 qk_norm_rope with
    # the K/V store
    assert len(report) == 58, sorted(report)
