"""Rank 0's and a worker's CPU cost per decode step, without a model, before and after.

    python launch/bench_control_plane.py                          # this checkout only
    python launch/bench_control_plane.py --before 89b264d         # + that commit, same run
    python launch/bench_control_plane.py --before 89b264d --repeat 5   # medians of 5 rounds
    python launch/bench_control_plane.py --num-seqs 256 --prompt-len 1024 8192 32768

Runs `benchmarks/control_plane.py` (schedule, plan, encode and update on rank 0; plan decode and
input building on a worker; plan bytes per step) against this checkout and, with `--before`,
against a temporary git worktree of that commit, on the same machine, and writes both with
their ratios to one JSON result.

Every size is measured after and before one right after the other (one process each), and
with `--repeat` that round is run several times and each figure is the median over the rounds:
on a shared machine whatever else runs slows both sides of a ratio alike. The JSON keeps every
round's raw result beside the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The benchmark harness (`benchmarks/`) lives in the checkout, not in the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results import REPO_ROOT, environment, write_json


def measure(
    root: Path, args: argparse.Namespace, num_seqs: int, prompt_len: int, out: Path
) -> dict:
    cmd = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "control_plane.py"), "--root", str(root),
        "--num-seqs", str(num_seqs), "--prompt-len", str(prompt_len),
        "--num-steps", str(args.num_steps), "--block-size", str(args.block_size),
        "--out", str(out),
    ]  # fmt: skip
    print(f"$ {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def median_of(rounds: list[Any]) -> Any:
    """The rounds' results with every measured number replaced by its median over the rounds
    (the sizes, equal in every round, stay what they are)."""
    first = rounds[0]
    if isinstance(first, dict):
        return {key: median_of([r[key] for r in rounds]) for key in first}
    if isinstance(first, (int, float)) and any(r != first for r in rounds):
        return statistics.median(rounds)
    return first


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--before", default=None, help="a commit to measure beside this checkout")
    p.add_argument("--num-seqs", type=int, nargs="+", default=[64, 256, 512, 1024])
    p.add_argument("--prompt-len", type=int, nargs="+", default=[256])
    p.add_argument("--num-steps", type=int, default=50)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--repeat", type=int, default=1, help="rounds over every size; figures are their medians"
    )
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)

    sizes = [(n, prompt_len) for prompt_len in args.prompt_len for n in args.num_seqs]
    with tempfile.TemporaryDirectory(prefix="tpe-cp-") as tmp:
        roots = {"after": REPO_ROOT}
        if args.before:
            worktree = Path(tmp) / "before"
            subprocess.run(
                ["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", str(worktree),
                 args.before], check=True, capture_output=True,
            )  # fmt: skip
            roots["before"] = worktree
        # name -> (num_seqs, prompt_len) -> one result per round
        rounds: dict[str, dict[tuple[int, int], list[dict]]] = {
            name: {size: [] for size in sizes} for name in roots
        }
        v2: dict[str, bool] = {}
        try:
            for _ in range(args.repeat):
                for n, prompt_len in sizes:
                    for name, root in roots.items():
                        run = measure(root, args, n, prompt_len, Path(tmp) / f"{name}.json")
                        v2[name] = run["v2"]
                        rounds[name][(n, prompt_len)] += run["results"]
        finally:
            if args.before:
                subprocess.run(
                    ["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force",
                     str(roots["before"])], check=False, capture_output=True,
                )  # fmt: skip
    runs = {
        name: {
            "root": str(roots[name]) if name == "after" else args.before,
            "v2": v2[name],
            "results": [median_of(rounds[name][size]) for size in sizes],
            "rounds": [rounds[name][size] for size in sizes],
        }
        for name in roots
    }
    result: dict = {"benchmark": "control_plane", **environment(), "before_commit": args.before,
                    "repeat": args.repeat, **runs}  # fmt: skip
    for row in runs["after"]["results"]:
        print(
            f"after {row['num_seqs']:>6} seqs x {row['prompt_len']:>6}: rank 0 "
            f"{row['rank0_us']['median']:8.1f} us, worker {row['worker_us']['median']:8.1f} us, "
            f"plan {row['plan_bytes']['mean']:.0f} B (median of {args.repeat})"
        )
    if "before" in runs:
        result["rank0_speedup"] = [
            {
                "num_seqs": a["num_seqs"],
                "prompt_len": a["prompt_len"],
                "before_us": b["rank0_us"]["median"],
                "after_us": a["rank0_us"]["median"],
                "after_over_before": a["rank0_us"]["median"] / b["rank0_us"]["median"],
                "worker_before_us": b["worker_us"]["median"],
                "worker_after_us": a["worker_us"]["median"],
            }
            for a, b in zip(runs["after"]["results"], runs["before"]["results"], strict=True)
        ]
        for row in result["rank0_speedup"]:
            print(
                f"{row['num_seqs']:>6} seqs x {row['prompt_len']:>6}: rank 0 "
                f"{row['before_us']:8.1f} -> {row['after_us']:8.1f} us "
                f"({row['after_over_before']:.3f} of before); worker "
                f"{row['worker_before_us']:.1f} -> {row['worker_after_us']:.1f} us"
            )
    path = args.output_json or (
        REPO_ROOT / "benchmarks/results" / f"control-plane-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    write_json(path, result)
    print(f"Result: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
