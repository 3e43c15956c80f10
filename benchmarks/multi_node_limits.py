"""The worked example of `benchmarks.parallel_limits`: Qwen3-235B-A22B in bf16 on 2 x 8 H100 SXM.

    python -m benchmarks.multi_node_limits [--output-json PATH] [--ib-nics 8] [--no-latency]

Layouts: (a) TP 16 over both nodes, (b) TP 8 inside each node x PP 2 across them (vLLM's advice
for 2 x 8), (c) TP 8 on one node, for comparison. For each: memory per rank and KV room, the
decode step's limit at each batch with every sequence at `--context-len` tokens (one batch in
flight, and with PP also P micro-batches in flight as vLLM's batch queue keeps), the prefill of
one `--prompt-len` prompt (whole, and with PP in chunks through a flushed pipeline), and what
the figures become under other link assumptions (`sensitivity`). Markdown tables on stdout;
everything, per stage, in the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks.limits import ModelShape
from benchmarks.parallel_limits import (
    H100_SXM,
    IB_NDR400,
    NVLINK4_H100,
    Layout,
    Schedule,
    StepLimit,
    Work,
    kv_replication,
    rank_memory,
    step_limit,
)
from benchmarks.results import git_commit, git_dirty

# The fields of Qwen/Qwen3-235B-A22B's published config.json that the limit reads
# (transformers 4.51.0; every layer sparse: decoder_sparse_step 1, no mlp_only_layers).
QWEN3_235B_A22B_CONFIG: dict[str, Any] = {
    "hidden_size": 4096,
    "num_hidden_layers": 94,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 12288,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 1536,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}

LAYOUTS: dict[str, Layout] = {
    "TP16 (2 nodes)": Layout(tp_size=16),
    "TP8 x PP2 (2 nodes)": Layout(tp_size=8, pp_size=2),
    "TP8 (1 node)": Layout(tp_size=8),
}
PREFILL_CHUNKS = 4  # the pipelined prefill's chunks, with PP

GB = 1e9


def _links(layout: Layout, nics: int, nvlink_latency_s: float, ib_latency_s: float) -> Layout:
    return replace(
        layout,
        intra_node=replace(layout.intra_node, latency_s=nvlink_latency_s),
        inter_node=replace(layout.inter_node, latency_s=ib_latency_s),
        inter_node_nics=nics,
    )


def _step(limit: StepLimit, kv_tokens_needed: float, kv_capacity: int) -> dict[str, Any]:
    stages = limit.stages
    return {
        "micro_batches": limit.micro_batches,
        "schedule": limit.schedule.value,
        "kv_tokens_needed": kv_tokens_needed,
        "kv_fits": kv_tokens_needed <= kv_capacity,
        "step_ms": limit.step_s * 1e3,
        "tokens_per_s": limit.tokens_per_s,
        "balanced_tokens_per_s": limit.balanced_tokens_per_s,
        "compute_ms": sum(s.compute_s for s in stages) * 1e3,
        "memory_ms": sum(s.memory_s for s in stages) * 1e3,
        "comm_ms": sum(s.comm_s for s in stages) * 1e3,
        "comm_share": limit.comm_share,
        "idle_fraction": limit.idle_fraction,
        "stages": [
            {**asdict(s), "roofline_s": s.roofline_s, "comm_s": s.comm_s, "time_s": s.time_s}
            for s in stages
        ],
    }


def layout_report(
    shape: ModelShape,
    layout: Layout,
    *,
    batches: list[int],
    context_len: int,
    prompt_len: int,
    memory_utilization: float,
) -> dict[str, Any]:
    p = layout.pp_size
    memory = [
        rank_memory(shape, layout, s, memory_utilization=memory_utilization) for s in range(p)
    ]
    capacity = min(m.max_kv_tokens for m in memory)
    decode = []
    for b in batches:
        runs = [(1, Work.decode(b, context_len))]
        if p > 1 and b % p == 0:
            runs.append((p, Work.decode(b // p, context_len)))
        for m, work in runs:
            limit = step_limit(shape, layout, work, micro_batches=m, schedule=Schedule.IN_FLIGHT)
            decode.append({"batch": b, **_step(limit, b * context_len, capacity)})
    prefill = []
    for chunks in [1, PREFILL_CHUNKS] if p > 1 else [1]:
        limit = step_limit(
            shape,
            layout,
            Work.prefill(prompt_len, chunks),
            micro_batches=chunks,
            schedule=Schedule.FLUSHED,
        )
        prefill.append({"prompt_len": prompt_len, **_step(limit, prompt_len, capacity)})
    return {
        "tp_size": layout.tp_size,
        "pp_size": p,
        "nodes": layout.num_nodes,
        "tp_link": layout.tp_link.name,
        "tp_spans_nodes": layout.tp_spans_nodes,
        "kv_replication": kv_replication(shape, layout.tp_size),
        "memory": [{**asdict(m), "fits": m.fits, "max_kv_tokens": m.max_kv_tokens} for m in memory],
        "fits": all(m.fits for m in memory),
        "kv_capacity_tokens": capacity,
        "decode": decode,
        "prefill": prefill,
    }


def sensitivity(
    shape: ModelShape, *, batches: list[int], context_len: int, prompt_len: int
) -> list[dict[str, Any]]:
    """The headline times under other link assumptions."""
    variants = {
        "as above": (None, None, None),
        "cross-node ring over 8 NICs": (8, None, None),
        "no latency": (None, 0.0, 0.0),
        "8 NICs and no latency": (8, 0.0, 0.0),
    }
    rows = []
    for label, (nics, nv, ib) in variants.items():
        for name, base in LAYOUTS.items():
            layout = _links(
                base,
                nics or base.inter_node_nics,
                base.intra_node.latency_s if nv is None else nv,
                base.inter_node.latency_s if ib is None else ib,
            )
            row: dict[str, Any] = {"variant": label, "layout": name}
            for b in (batches[0], batches[-1]):
                m = layout.pp_size if b % layout.pp_size == 0 else 1
                work = Work.decode(b // m, context_len)
                row[f"decode_b{b}_ms"] = step_limit(shape, layout, work, micro_batches=m).step_s
                row[f"decode_b{b}_ms"] *= 1e3
            row["prefill_ms"] = step_limit(shape, layout, Work.prefill(prompt_len)).step_s * 1e3
            rows.append(row)
    return rows


def _md(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)])


def _ms(x: float) -> str:
    return f"{x:.2f}" if x < 100 else f"{x:.0f}"


def format_tables(result: dict[str, Any]) -> str:
    mem, dec, pre = [], [], []
    for name, r in result["layouts"].items():
        for m in r["memory"]:
            mem.append([
                name, str(m["stage"]), str(m["layers"]), f"{m['weight_bytes'] / GB:.1f}",
                f"{m['kv_bytes_per_token']:,.0f}", f"x{r['kv_replication']}",
                f"{m['kv_budget_bytes'] / GB:.1f}", f"{m['max_kv_tokens']:,}",
                "yes" if m["fits"] else "no",
            ])  # fmt: skip
        for d in r["decode"]:
            dec.append([
                name, str(d["batch"]), f"{d['micro_batches']} {d['schedule']}",
                "yes" if d["kv_fits"] else f"no ({d['kv_tokens_needed']:,.0f})",
                _ms(d["step_ms"]), f"{d['tokens_per_s']:,.0f}", _ms(d["compute_ms"]),
                _ms(d["memory_ms"]), _ms(d["comm_ms"]), f"{d['comm_share']:.0%}",
                f"{d['idle_fraction']:.0%}",
            ])  # fmt: skip
        for p in r["prefill"]:
            pre.append([
                name, f"{p['micro_batches']} {p['schedule']}", _ms(p["step_ms"]),
                _ms(p["compute_ms"]), _ms(p["memory_ms"]), _ms(p["comm_ms"]),
                f"{p['comm_share']:.0%}", f"{p['idle_fraction']:.0%}",
            ])  # fmt: skip
    a = result["assumptions"]
    batches = result["batches"]
    sens = [
        [s["variant"], s["layout"], _ms(s[f"decode_b{batches[0]}_ms"]),
         _ms(s[f"decode_b{batches[-1]}_ms"]), _ms(s["prefill_ms"])]
        for s in result["sensitivity"]
    ]  # fmt: skip
    return "\n\n".join([
        f"Qwen3-235B-A22B bf16 ({result['weight_params'] / 1e9:.2f}B parameters, "
        f"{result['weight_params'] * 2 / GB:.0f} GB) on H100 SXM: {a['hbm_gb']:.0f} GB at "
        f"utilization {a['memory_utilization']}, {a['peak_tflops']:.0f} TFLOP/s, "
        f"{a['peak_hbm_gbs']:.0f} GB/s; NVLink {a['nvlink_gbs']:.0f} GB/s + "
        f"{a['nvlink_latency_us']:g} us, IB {a['ib_gbs']:.0f} GB/s x {a['ib_nics']} NIC(s) + "
        f"{a['ib_latency_us']:g} us per collective or send",
        "Memory per rank\n\n" + _md(
            ["layout", "stage", "layers", "weights GB", "KV B/token", "KV heads",
             "KV room GB", "max KV tokens", "fits"], mem),
        f"Decode step, every sequence at {result['context_len']} tokens (step = TPOT; "
        "compute, memory and comm: one micro-batch's path through the stages)\n\n" + _md(
            ["layout", "batch", "micro-batches", "KV fits", "step ms", "tok/s", "compute ms",
             "memory ms", "comm ms", "comm share", "idle"], dec),
        f"Prefill of one {result['prompt_len']}-token prompt (compute, memory, comm: one "
        "chunk's path)\n\n" + _md(
            ["layout", "chunks", "time ms", "compute ms", "memory ms", "comm ms",
             "comm share", "idle"], pre),
        "Sensitivity: decode step ms (PP: P micro-batches in flight) and whole prefill ms\n\n"
        + _md(["links", "layout", f"decode B={batches[0]}", f"decode B={batches[-1]}",
               "prefill"], sens),
    ])  # fmt: skip


def run(
    *,
    batches: list[int],
    context_len: int,
    prompt_len: int,
    memory_utilization: float,
    ib_nics: int,
    nvlink_latency_s: float,
    ib_latency_s: float,
) -> dict[str, Any]:
    shape = ModelShape.from_hf_config(QWEN3_235B_A22B_CONFIG)
    layouts = {
        name: _links(layout, ib_nics, nvlink_latency_s, ib_latency_s)
        for name, layout in LAYOUTS.items()
    }
    kw = dict(batches=batches, context_len=context_len, prompt_len=prompt_len)
    return {
        "model": "Qwen/Qwen3-235B-A22B",
        "config": QWEN3_235B_A22B_CONFIG,
        "weight_params": shape.weight_params,
        "batches": batches,
        "context_len": context_len,
        "prompt_len": prompt_len,
        "assumptions": {
            "hbm_gb": H100_SXM.hbm_bytes / GB,
            "memory_utilization": memory_utilization,
            "peak_tflops": H100_SXM.peaks.flops_per_s / 1e12,
            "peak_hbm_gbs": H100_SXM.peaks.bytes_per_s / GB,
            "nvlink_gbs": NVLINK4_H100.bytes_per_s / GB,
            "nvlink_latency_us": nvlink_latency_s * 1e6,
            "ib_gbs": IB_NDR400.bytes_per_s / GB,
            "ib_nics": ib_nics,
            "ib_latency_us": ib_latency_s * 1e6,
            "sources": [H100_SXM.peaks.source, NVLINK4_H100.source, IB_NDR400.source],
            "bytes": "bf16 weights, KV and activations (2 bytes)",
        },
        "layouts": {
            name: layout_report(shape, layout, memory_utilization=memory_utilization, **kw)
            for name, layout in layouts.items()
        },
        "sensitivity": sensitivity(shape, **kw),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--context-len", type=int, default=2048)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--memory-utilization", type=float, default=0.9)
    parser.add_argument("--ib-nics", type=int, default=1, help="NICs a cross-node ring uses")
    parser.add_argument("--nvlink-latency-us", type=float, default=NVLINK4_H100.latency_s * 1e6)
    parser.add_argument("--ib-latency-us", type=float, default=IB_NDR400.latency_s * 1e6)
    parser.add_argument("--no-latency", action="store_true", help="both latencies 0")
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args(argv)
    result = run(
        batches=args.batches,
        context_len=args.context_len,
        prompt_len=args.prompt_len,
        memory_utilization=args.memory_utilization,
        ib_nics=args.ib_nics,
        nvlink_latency_s=0.0 if args.no_latency else args.nvlink_latency_us * 1e-6,
        ib_latency_s=0.0 if args.no_latency else args.ib_latency_us * 1e-6,
    )
    result["command"] = "python -m benchmarks.multi_node_limits " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    result["commit"], result["worktree_dirty"] = git_commit(), git_dirty()
    print(format_tables(result))
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
