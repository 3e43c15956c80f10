"""Plots from benchmark result files (needs matplotlib: `pip install -e .[bench]`).

    python launch/plot.py throughput benchmarks/results/cpu/bench-*.json --x num_seqs -o tput.png
    python launch/plot.py latency benchmarks/results/cpu/serving-*.json -o latency.png

`throughput`: output tokens/s of `launch/bench.py` results against a workload figure (`--x`:
num_seqs, max_input_len, max_output_len or max_num_seqs), one line per model and TP size, with
the limit's tokens/s dashed. `latency`: CDFs of TTFT, TPOT and ITL from `launch/bench_serving.py`
results, one line per file (its --label, else its request rate).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np


def _x_value(result: dict, key: str) -> float:
    work = result["workload"]
    if key == "num_seqs":
        return work["num_seqs"]
    if key == "max_input_len":
        return work["input_len"][1]
    if key == "max_output_len":
        return work["output_len"][1]
    return result["engine_args"][key]


def plot_throughput(files: list[Path], x_key: str, out: Path) -> None:
    series: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for f in files:
        r = json.loads(f.read_text())
        label = f"{r['model']} TP={r['tensor_parallel_size']} ({r['device']})"
        series[label].append(
            (_x_value(r, x_key), r["output_tokens_per_s"], r["limit_output_tokens_per_s"])
        )
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in sorted(series.items()):
        points.sort()
        xs, ys, limits = zip(*points, strict=True)
        (line,) = ax.plot(xs, ys, marker="o", label=label)
        ax.plot(xs, limits, linestyle="--", color=line.get_color(), label=f"{label} limit")
    ax.set_xlabel(x_key)
    ax.set_ylabel("output tokens/s")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Offline throughput (launch/bench.py)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def plot_latency(files: list[Path], out: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for f in files:
        r = json.loads(f.read_text())
        label = r.get("label") or f"rate {r['request_rate']}"
        tpot = [
            (lat - ttft) / (n - 1)
            for lat, ttft, n in zip(r["latencies_s"], r["ttfts_s"], r["output_lens"], strict=True)
            if n > 1
        ]
        itl = [gap for gaps in r["itls_s"] for gap in gaps]
        for ax, values in zip(axes, (r["ttfts_s"], tpot, itl), strict=True):
            ms = np.sort(np.asarray(values) * 1000.0)
            if ms.size:
                ax.plot(ms, np.arange(1, ms.size + 1) / ms.size, label=label)
    for ax, name in zip(axes, ("TTFT", "TPOT", "ITL"), strict=True):
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Serving latency CDFs (launch/bench_serving.py)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="kind", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("files", nargs="+", type=Path)
    t.add_argument(
        "--x",
        default="num_seqs",
        choices=["num_seqs", "max_input_len", "max_output_len", "max_num_seqs"],
    )
    t.add_argument("-o", "--output", type=Path, default=Path("throughput.png"))
    lat = sub.add_parser("latency")
    lat.add_argument("files", nargs="+", type=Path)
    lat.add_argument("-o", "--output", type=Path, default=Path("latency.png"))
    args = p.parse_args(argv)
    if args.kind == "throughput":
        plot_throughput(args.files, args.x, args.output)
    else:
        plot_latency(args.files, args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
