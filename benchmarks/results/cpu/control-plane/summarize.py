"""Print this folder's figures as the README's tables, and draw the engine's rank-0 phases
before and after (`rank0-phases-demo.png`): python summarize.py [FOLDER]."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

here = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)


def control_plane() -> None:
    d = json.loads((here / "control-plane-before-after.json").read_text())
    print("| running decodes | rank 0 before | rank 0 after | after / before "
          "| schedule / plan / encode / update after | worker before | worker after |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for a, b in zip(d["after"]["results"], d["before"]["results"], strict=True):
        m = a["median_us"]
        print(
            f"| {a['num_seqs']} | {b['rank0_us']['median']:.0f} µs | {a['rank0_us']['median']:.0f} µs "
            f"| {a['rank0_us']['median'] / b['rank0_us']['median']:.3f} "
            f"| {m['schedule']:.0f} / {m['plan']:.0f} / {m['encode']:.0f} / {m['update']:.0f} µs "
            f"| {b['worker_us']['median']:.0f} µs | {a['worker_us']['median']:.0f} µs |"
        )


def plan_bytes() -> None:
    d = json.loads((here / "plan-bytes-by-context.json").read_text())
    print("| context (prompt tokens) | plan bytes after (mean / median / max) | before (mean) "
          "| rank 0 before | rank 0 after |")  # fmt: skip
    print("|---|---|---|---|---|")
    for a, b in zip(d["after"]["results"], d["before"]["results"], strict=True):
        pa, pb = a["plan_bytes"], b["plan_bytes"]
        print(
            f"| {a['prompt_len']} | {pa['mean']:.0f} / {pa['median']:.0f} / {pa['max']} "
            f"| {pb['mean']:.0f} | {b['rank0_us']['median']:.0f} µs "
            f"| {a['rank0_us']['median']:.0f} µs |"
        )


def step_phases(n: int, side: str) -> tuple[list[float], dict[str, float]]:
    """Output tok/s of every run, and the median over runs of each phase's median per step."""
    runs = sorted(here.glob(f"bench-demo-tp1-seqs{n}-{side}-run*.json"))
    results = [json.loads(f.read_text()) for f in runs]
    phases: dict[str, list[float]] = {}
    for r in results:
        for name, s in r["step_timeline_summary"].items():
            phases.setdefault(name, []).append(s["median_us"])
    return [r["output_tokens_per_s"] for r in results], {
        k: statistics.median(v) for k, v in phases.items()
    }


def plot_phases(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ("schedule", "build_plan", "update")
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
    for ax, n in zip(axes, (16, 64), strict=True):
        for i, side in enumerate(("before", "after")):
            med = step_phases(n, side)[1]
            xs = [j + (i - 0.5) * 0.38 for j in range(len(names))]
            ax.bar(xs, [med[k] for k in names], width=0.38, label=side)
        ax.set_xticks(range(len(names)), names)
        ax.set_title(f"demo model, {n} sequences")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("median per step (µs)")
    axes[0].legend()
    fig.suptitle("Rank 0's step phases besides the forward pass (medians of 20 runs)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def throughput() -> None:
    print("| sequences | side | output tok/s, median (runs) | schedule | build_plan | forward "
          "| sample | update |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for n in (16, 64):
        ratios = [
            json.loads((here / f"bench-demo-tp1-seqs{n}-after-run{r}.json").read_text())[
                "output_tokens_per_s"
            ]
            / json.loads((here / f"bench-demo-tp1-seqs{n}-before-run{r}.json").read_text())[
                "output_tokens_per_s"
            ]
            for r in range(1, len(step_phases(n, "after")[0]) + 1)
        ]
        for side in ("before", "after"):
            tps, med = step_phases(n, side)
            print(
                f"| {n} | {side} | {statistics.median(tps):.0f} ({len(tps)}) "
                + " ".join(
                    f"| {med[k]:.0f} µs"
                    for k in ("schedule", "build_plan", "forward", "sample", "update")
                )
                + " |"
            )
        print(
            f"| {n} | after / before, paired by round | median {statistics.median(ratios):.2f}, "
            f"mean {statistics.mean(ratios):.2f}, after ahead in {sum(r > 1 for r in ratios)} "
            f"of {len(ratios)} | | | | | |"
        )


if __name__ == "__main__":
    control_plane()
    print()
    plan_bytes()
    print()
    throughput()
    plot_phases(here / "rank0-phases-demo.png")
