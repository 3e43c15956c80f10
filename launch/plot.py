"""Plots from benchmark result files (needs matplotlib: `pip install -e .[bench]`).

    python launch/plot.py throughput benchmarks/results/cpu/after/bench-*.json --x num_seqs -o tput.png
    python launch/plot.py latency benchmarks/results/cpu/after/serving-*.json -o latency.png
    python launch/plot.py timeline timeline.json -o timeline.png --steps 100:120

`throughput`: output tokens/s of `launch/bench.py` results against a workload figure (`--x`:
num_seqs, max_input_len, max_output_len or max_num_seqs), one line per model and TP size, with
the limit's tokens/s dashed. `latency`: CDFs of TTFT, TPOT and ITL from `launch/bench_serving.py`
results, one line per file (its --label, else its request rate). `timeline`: rank 0's step
phases from `launch/bench.py --step-timeline PATH` (PATH, or the result file that names it): a
Gantt chart, time in ms against one lane per phase, and below it each step's phase durations in
µs stacked, with the step's wall time (first start to last end) as dots; a phase nested in
another is counted twice in the stack, so dots below the stack's top mean nesting. `--steps A:B`
picks step ids A..B-1 (either end may be left out); the default is the 20 steps in the middle.
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
        if r.get("per_token_timing_refused"):  # not observed: TTFT only
            tpot = itl = []
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


# The engine's phases in step order; each keeps its colour across plots, whichever are present.
_KNOWN_PHASES = ("schedule", "build_plan", "broadcast", "forward", "sample", "update")


def _load_timeline(path: Path) -> dict:
    """A `--step-timeline` file, or the bench result whose "step_timeline" names one."""
    data = json.loads(path.read_text())
    if "records" in data:
        return data
    if "step_timeline" not in data:
        raise SystemExit(f"{path} holds no step timeline (run launch/bench.py --step-timeline)")
    named = Path(data["step_timeline"])
    # The name as bench.py was given it: relative to where it ran, or beside the result file.
    timeline = named if named.exists() else path.parent / named.name
    return json.loads(timeline.read_text())


def _window(step_ids: list[int], spec: str | None, default_len: int = 20) -> list[int]:
    if spec is None:
        first = max(0, (len(step_ids) - default_len) // 2)
        return step_ids[first : first + default_len]
    lo, sep, hi = spec.partition(":")
    if not sep:
        raise SystemExit(f"--steps takes A:B, got {spec!r}")
    lo_id = int(lo) if lo else step_ids[0]
    hi_id = int(hi) if hi else step_ids[-1] + 1
    chosen = [s for s in step_ids if lo_id <= s < hi_id]
    if not chosen:
        raise SystemExit(f"no steps in {spec}; the file has steps {step_ids[0]}..{step_ids[-1]}")
    return chosen


def plot_timeline(path: Path, steps: str | None, out: Path) -> None:
    data = _load_timeline(path)
    records = [(int(s), str(p), float(a), float(b)) for s, p, a, b in data["records"]]
    if not records:
        raise SystemExit(f"{path}: the step timeline has no records")
    window = _window(sorted({r[0] for r in records}), steps)
    shown = set(window)
    records = [r for r in records if r[0] in shown]
    phases = [p for p in data["phases"] if any(r[1] == p for r in records)]
    others = [p for p in phases if p not in _KNOWN_PHASES]
    colors = {
        p: plt.cm.tab10(
            (_KNOWN_PHASES.index(p) if p in _KNOWN_PHASES else len(_KNOWN_PHASES) + others.index(p))
            % 10
        )
        for p in phases
    }
    t0 = min(r[2] for r in records)
    step_start: dict[int, float] = {}
    step_end: dict[int, float] = {}
    durations: dict[tuple[int, str], float] = defaultdict(float)
    for sid, phase, a, b in records:
        step_start[sid] = min(a, step_start.get(sid, a))
        step_end[sid] = max(b, step_end.get(sid, b))
        durations[sid, phase] += b - a

    fig, (gantt, stack) = plt.subplots(
        2, 1, figsize=(11, 2.0 + 0.45 * len(phases) + 3.5), height_ratios=[len(phases) + 1, 4]
    )
    for lane, phase in enumerate(phases):
        bars = [((a - t0) * 1e3, (b - a) * 1e3) for _, p, a, b in records if p == phase]
        # The edge keeps microsecond phases visible as lines beside millisecond ones.
        gantt.broken_barh(bars, (lane - 0.4, 0.8), color=colors[phase], linewidth=0.8)
    for s in window:
        a = step_start[s]
        gantt.axvline((a - t0) * 1e3, color="0.6", linewidth=0.6, zorder=0)
        if len(window) <= 40:
            gantt.text((a - t0) * 1e3, -0.7, str(s), fontsize=6, color="0.4", va="bottom")
    gantt.set_yticks(range(len(phases)), phases)
    gantt.set_ylim(len(phases) - 0.5, -0.9)
    gantt.set_xlabel(f"time (ms) from the start of step {window[0]}")
    gantt.grid(True, axis="x", alpha=0.3)

    x = np.arange(len(window))
    bottom = np.zeros(len(window))
    for phase in phases:
        us = np.array([durations[s, phase] * 1e6 for s in window])
        stack.bar(x, us, bottom=bottom, color=colors[phase], label=phase, width=0.8)
        bottom += us
    wall = [(step_end[s] - step_start[s]) * 1e6 for s in window]
    stack.plot(x, wall, "k.", label="step wall time")
    stack.set_ylim(0, max(max(wall), bottom.max()) * 1.3)  # headroom for the legend
    stack.set_xticks(x, [str(s) for s in window], fontsize=7, rotation=90 if len(x) > 30 else 0)
    stack.set_xlabel("step")
    stack.set_ylabel("µs")
    stack.grid(True, axis="y", alpha=0.3)
    stack.legend(fontsize=7, ncol=min(len(phases) + 1, 7), loc="upper left")

    where = (
        f"{data['model']} TP={data['tensor_parallel_size']} ({data['device']})"
        if "model" in data
        else path.name
    )
    fig.suptitle(f"Rank 0 step timeline, steps {window[0]}..{window[-1]}: {where}")
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
    tl = sub.add_parser("timeline")
    tl.add_argument("file", type=Path, help="a --step-timeline file, or the result naming it")
    tl.add_argument("--steps", default=None, metavar="A:B", help="step ids A..B-1")
    tl.add_argument("-o", "--output", type=Path, default=Path("timeline.png"))
    args = p.parse_args(argv)
    if args.kind == "throughput":
        plot_throughput(args.files, args.x, args.output)
    elif args.kind == "latency":
        plot_latency(args.files, args.output)
    else:
        plot_timeline(args.file, args.steps, args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
