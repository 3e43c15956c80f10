"""Where a served request's time to first token goes, stage by stage, on any machine.

    python -m benchmarks.ttft_breakdown --output-json OUT.json [--model DIR] [--rate 8]
        [--num-prompts 40] [--input-len 1024] [--output-len 32] [-- SERVER FLAGS...]

Starts the real server (`launch/serve.py`, both processes) on a small random Qwen3 with Qwen3's
tokenizer and `TP_ENGINE_REQUEST_TRACE` set (`tp_engine.server.request_trace`), sends
streamed completions at a Poisson rate with `benchmarks.serving_client` (1k-token prompts by
default, as the H200 serving run of 2026-11-27), then joins the client's times with the two
processes' traces on the one monotonic clock. Per request, the TTFT splits into:

    http_in        client sends                -> route handler starts (connection, uvicorn)
    api_parse      route handler starts        -> AddRequest sent (body, validation, prompt)
    wait_step      AddRequest sent             -> rank 0's step in flight at that time ends
    ipc_in         that step ends (or the send) -> rank 0 reads the AddRequest
    engine         rank 0 reads it             -> the step returning its first token ends
                   (`steps`: loop steps it took; `queue` the part before its first schedule)
    r0_out         that step ends              -> rank 0 sends the outputs (the loop's flush)
    ipc_out        rank 0 sends                -> the API process reads them
    api_out        the API process reads them  -> first SSE chunk handed to the server
    http_out       first chunk handed over     -> the client reads it

They sum to the client's TTFT exactly. The model's compute on a CPU is not a GPU's; the hops,
the loop's waits and the API process's work are the same code on both.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# (name, from, to): consecutive stages; "step_end" is the end of the step in flight at api_add.
GAPS = [
    ("http_in", "client_sent", "api_route"),
    ("api_parse", "api_route", "api_add"),
    ("wait_step", "api_add", "step_end"),
    ("ipc_in", "step_end", "r0_add"),
    ("engine", "r0_add", "r0_first_out"),
    ("r0_out", "r0_first_out", "r0_sent"),
    ("ipc_out", "r0_sent", "api_delta"),
    ("api_out", "api_delta", "api_chunk"),
    ("http_out", "api_chunk", "client_first"),
]

# The small model: Qwen3's tokenizer and vocabulary (detokenizing and sampling its 151,936
# rows cost what they cost on a real model), the rest tiny so the forward is cheap on a CPU.
MODEL = dict(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=128, vocab_size=151_936, max_position_embeddings=4096,
    tokenizer="qwen3", seed=0,
)  # fmt: skip


def read_traces(directory: Path) -> tuple[dict[str, dict[str, dict]], list[dict]]:
    """(request id -> stage -> event, rank 0's steps in order) from every trace file."""
    events: dict[str, dict[str, dict]] = {}
    steps: list[dict] = []
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event["stage"] == "step":
                steps.append(event)
            else:
                events.setdefault(event["id"], {}).setdefault(event["stage"], event)
    steps.sort(key=lambda s: s["start"])
    return events, steps


def breakdown(results: list[Any], events: dict, steps: list[dict]) -> list[dict[str, float]]:
    """One row per request that has every stage: each gap in ms, the TTFT, the steps taken."""
    rows = []
    for r in results:
        if not r.success or not r.response_id:
            continue
        stages = events.get(f"{r.response_id}-0", {})
        if not all(s in stages for s in ("api_route", "api_add", "r0_add", "r0_first_out",
                                          "r0_sent", "api_delta", "api_chunk")):  # fmt: skip
            continue
        t = {name: stages[name]["t"] for name in stages}
        t["client_sent"], t["client_first"] = r.sent_at_s, r.first_chunk_at_s
        # The step rank 0 was in when the request reached it: the loop reads its inbox only
        # between steps. None in flight: the request went straight in.
        in_flight = [s for s in steps if s["start"] <= t["api_add"] < s["end"]]
        t["step_end"] = in_flight[0]["end"] if in_flight else t["api_add"]
        t["step_end"] = min(max(t["step_end"], t["api_add"]), t["r0_add"])
        row = {name: (t[b] - t[a]) * 1e3 for name, a, b in GAPS}
        row["ttft"] = (t["client_first"] - t["client_sent"]) * 1e3
        row["client_ttft"] = r.ttft_s * 1e3
        taken = [s for s in steps if t["r0_add"] <= s["end"] <= t["r0_first_out"]]
        row["steps"] = float(len(taken))
        row["step_ms"] = statistics.median([(s["end"] - s["start"]) * 1e3 for s in taken] or [0])
        queue = stages["r0_first_out"].get("queue_time_s")
        row["queue"] = (queue or 0.0) * 1e3
        rows.append(row)
    return rows


def summarize(rows: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    keys = [name for name, _, _ in GAPS] + ["ttft", "steps", "step_ms", "queue"]
    return {
        k: {
            "median": statistics.median(r[k] for r in rows),
            "mean": statistics.fmean(r[k] for r in rows),
        }
        for k in keys
    }


def format_table(summary: dict[str, dict[str, float]]) -> str:
    lines = [f"{'stage':<12}{'median ms':>12}{'mean ms':>12}"]
    for name, stats in summary.items():
        lines.append(f"{name:<12}{stats['median']:>12.3f}{stats['mean']:>12.3f}")
    return "\n".join(lines)


_SERVING = re.compile(r"serving .* on http://([\w.\-\[\]:]+):(\d+)")


@contextlib.contextmanager
def serving(cmd: list[str], env: dict[str, str], log_path: Path) -> Iterator[str]:
    """Run the server (`cmd`) in a session of its own with its log in `log_path`; yields its
    base URL once /health answers; SIGTERM (a graceful drain) at the end, then SIGKILL to the
    session if it lingers."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start; its log: {log_path}")
                match = _SERVING.search(log_path.read_text(errors="replace"))
                if match:
                    url = f"http://{match.group(1)}:{match.group(2)}"
                    with (
                        contextlib.suppress(OSError),
                        urllib.request.urlopen(url + "/health", timeout=5) as health,
                    ):
                        if health.status == 200:
                            break
                time.sleep(0.2)
            yield url
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.serving_client import random_requests, run_benchmark
    from tp_engine.testing import build_random_qwen3

    work = Path(tempfile.mkdtemp(prefix="ttft-breakdown-"))
    model_dir = args.model or build_random_qwen3(work / "model", **MODEL)
    trace_dir = work / "trace"
    env = dict(os.environ, TP_ENGINE_REQUEST_TRACE=str(trace_dir))
    env.pop("TP_ENGINE_FAULT", None)
    serve = str(Path(__file__).resolve().parents[1] / "launch" / "serve.py")
    cmd = [sys.executable, serve, "--model", str(model_dir), "--port", "0", *args.server_args]
    with serving(cmd, env, work / "server.log") as base_url:
        with urllib.request.urlopen(base_url + "/v1/models", timeout=30) as resp:
            model = json.loads(resp.read())["data"][0]["id"]
        # A warm-up request, untimed: the first step of a server compiles and allocates.
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        warm = random_requests(2, args.input_len, 4, seed=99, vocab_size=vocab)
        asyncio.run(run_benchmark(base_url, model, warm))
        requests = random_requests(
            args.num_prompts, args.input_len, args.output_len, range_ratio=0.5,
            vocab_size=vocab, seed=args.seed,
        )  # fmt: skip
        results, duration = asyncio.run(
            run_benchmark(base_url, model, requests, args.rate, seed=args.seed)
        )
    events, steps = read_traces(trace_dir)
    rows = breakdown(results, events, steps)
    if not rows:
        raise SystemExit(f"no request was traced end to end; server log: {work / 'server.log'}")
    summary = summarize(rows)
    return {
        "benchmark": "ttft_breakdown",
        "model": str(args.model) if args.model else MODEL,
        "rate": args.rate,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "server_args": args.server_args,
        "failed": sum(not r.success for r in results),
        "traced": len(rows),
        "duration_s": duration,
        "summary_ms": summary,
        "requests_ms": rows,
        # Rank 0's loop steps, [start, end] in ms from the first, and the outputs each returned:
        # a step that carries a prompt against a decode step (on a GPU, its host's share).
        "steps": [
            [
                (s["start"] - steps[0]["start"]) * 1e3,
                (s["end"] - steps[0]["start"]) * 1e3,
                s["outputs"],
            ]
            for s in steps
        ],
        "trace_dir": str(trace_dir),
        "server_log": str(work / "server.log"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", type=Path, default=None,
        help="a checkpoint to serve (on a GPU: the lease's 0.6B); default: the small CPU model",
    )  # fmt: skip
    p.add_argument("--rate", type=float, default=8.0)
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default=None)
    p.add_argument("--output-json", type=Path, required=True)
    p.add_argument("server_args", nargs="*", help="after --: flags for launch/serve.py")
    args = p.parse_args(argv)
    from benchmarks.results import environment

    result = {**environment(), "label": args.label, **run(args)}
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps(result, indent=1) + "\n")
    # The server's own log beside the figures: which steps took which path (graphs or eager),
    # capture time and memory, and any error a GPU run hit.
    shutil.copyfile(result["server_log"], args.output_json.with_suffix(".server.log"))
    print(format_table(result["summary_ms"]))
    print(f"{result['traced']} requests traced, {result['failed']} failed; {args.output_json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
