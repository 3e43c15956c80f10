"""Plan delivery latency per step: rank 0's `publish` to a worker holding the decoded plan,
for a reader on rank 0's node (the shared-memory ring) and one on "another node" (TCP on
loopback, `shm_ipc.remote`), side by side on the same plans.

    python -m benchmarks.plan_delivery --steps 400 --output-json out.json

Rank 0 and two reader processes (ranks 1 and 2, rank 2 told it is remote) on one host, so
CLOCK_MONOTONIC is one clock for all three: each reader stamps the moment `recv` returns, rank 0
the moment before `publish`. Plans are paced (`--gap-ms` apart) so that every figure is one
delivery, not a queue. The plan shapes are a serving step's: decodes only, and decodes beside
a prompt chunk. Loopback TCP has no wire: a real network adds its own latency (tens of
microseconds on a data-centre Ethernet or InfiniBand hop) on top of these.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any

import numpy as np

from shm_ipc import Command, PlanBroadcaster, PlanReceiver, StepPlan

# (name, decoding sequences, prompt tokens in the step)
SHAPES = [("decode 64", 64, 0), ("decode 256", 256, 0), ("256 decodes + 2k prompt", 256, 2048),
          ("8k prompt", 0, 8192)]  # fmt: skip


def plan_of(step_id: int, decodes: int, prompt: int) -> StepPlan:
    """A plan shaped as a serving step: `decodes` one-token rows and one `prompt`-token row,
    with a new block for every 16 prompt tokens."""
    rng = np.random.default_rng(step_id)
    lens = [1] * decodes + ([prompt] if prompt else [])
    num_tokens, num_seqs = sum(lens), len(lens)
    blocks = prompt // 16
    return StepPlan(
        step_id=step_id,
        command=Command.RUN,
        input_ids=rng.integers(0, 151_936, num_tokens, dtype=np.int32),
        query_start_loc=np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
        seq_lens=rng.integers(1, 4096, num_seqs, dtype=np.int32),
        rows=np.arange(num_seqs, dtype=np.int32),
        logits_indices=(np.cumsum(lens) - 1).astype(np.int32),
        edit_rows=np.array([num_seqs - 1] if blocks else [], dtype=np.int32),
        edit_starts=np.zeros(1 if blocks else 0, dtype=np.int32),
        edit_offsets=np.array([0, blocks] if blocks else [0], dtype=np.int32),
        edit_blocks=np.arange(blocks, dtype=np.int32),
    )


def reader(handle_bytes: bytes, rank: int, steps: int, conn: Any) -> None:
    from shm_ipc import ChannelHandle

    rx = PlanReceiver(ChannelHandle.from_bytes(handle_bytes), rank)
    stamps = []
    try:
        for _ in range(steps):
            plan = rx.recv(timeout_s=60)
            stamps.append((plan.step_id, time.monotonic_ns()))
        conn.send(stamps)
    finally:
        rx.close()


def measure(steps: int, gap_s: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    total = steps * len(SHAPES)
    with PlanBroadcaster(2, remote_readers=[2], nodes=[0, 0, 1], host="127.0.0.1") as bc:
        pipes, procs = [], []
        for rank in (1, 2):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=reader, args=(bc.handle.to_bytes(), rank, total, child))
            proc.start()
            pipes.append(parent)
            procs.append(proc)
        bc.wait_for_readers(60)
        sent: dict[int, tuple[str, int, int]] = {}  # step -> shape, bytes, publish time
        step = 0
        for name, decodes, prompt in SHAPES:
            plans = [plan_of(step + i, decodes, prompt) for i in range(steps)]
            for plan in plans:
                time.sleep(gap_s)
                start = time.monotonic_ns()
                bc.publish(plan)
                sent[plan.step_id] = (name, plan.encoded_size(), start)
            step += steps
        stamps = [dict(pipe.recv()) for pipe in pipes]
        for proc in procs:
            proc.join(30)
    rows = []
    for name, _, _ in SHAPES:
        ids = [s for s, (n, _, _) in sent.items() if n == name]
        row: dict[str, Any] = {"shape": name, "plan_bytes": sent[ids[0]][1]}
        for label, got in (("ring", stamps[0]), ("tcp", stamps[1])):
            us = sorted((got[s] - sent[s][2]) / 1e3 for s in ids)
            row[label] = {
                "median_us": round(statistics.median(us), 1),
                "p90_us": round(us[int(0.9 * (len(us) - 1))], 1),
                "min_us": round(us[0], 1),
            }
        rows.append(row)
    return {"steps_per_shape": steps, "gap_ms": gap_s * 1e3, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400, help="plans per shape")
    p.add_argument("--gap-ms", type=float, default=2.0, help="pause before each publish")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    result = measure(args.steps, args.gap_ms / 1e3)
    print(f"{'shape':<26} {'bytes':>8} {'ring median':>12} {'tcp median':>11} "
          f"{'ring p90':>9} {'tcp p90':>8}  (us, publish → plan decoded)")  # fmt: skip
    for row in result["rows"]:
        ring, tcp = row["ring"], row["tcp"]
        print(f"{row['shape']:<26} {row['plan_bytes']:>8} {ring['median_us']:>12} "
              f"{tcp['median_us']:>11} {ring['p90_us']:>9} {tcp['p90_us']:>8}")  # fmt: skip
    if args.output_json:
        from benchmarks.results import environment, write_json

        write_json(args.output_json, {"environment": environment(), **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
