"""KV transfer for prefill/decode disaggregation, between two processes on this machine with
Mooncake's transfer engine (TCP over loopback, P2P handshake): Mooncake's raw throughput on
large contiguous writes, then our path, `KVTransferEngine.write_blocks`, moving one prompt's KV
between two caches of the project's layout.

    python -m benchmarks.pd_transfer --output-json benchmarks/results/cpu/pd-transfer/pd-transfer.json

(a) raw: one `batch_transfer_sync_write` of N buffers of S bytes (through
`KVTransferEngine.write`, which is that one call when N <= its batch of 1000). (b) ours: the KV
of a 1k- and a 4k-token prompt in a Qwen3-0.6B-shaped cache (28 layers, 8 KV heads of 128,
bf16, blocks of 16 tokens) at TP 1 and TP 2 (one rank's share: 4 heads), the prompt's blocks
contiguous on both sides (2 x 28 transfers) or scattered at random over caches of 2x and 3x
the blocks needed (one transfer per block per layer and K/V). Beside each (b), its twin: the
raw write of the same shape (as many transfers, as long) over consecutive addresses, which
separates what our path adds from what Mooncake costs per transfer. (c) staged: the scattered
prompt through host staging pools (`rank_worker.kv.pd_staging`, for caches that cannot be
registered): the sender gathers its blocks into a pool and writes it, timed together; the
receiver's slots are consecutive (as its rank 0 hands them out), and its copy of them into
scattered blocks of its cache is timed apart, in this process on a cache of the same shape.

Each figure is `--repeats` timed runs after one warm-up, in rounds (every case once per round,
so a shared machine's load drifting falls on all alike); GiB/s on the bytes moved; "/ raw" is
(b)'s median over the best raw median of the large contiguous writes, "/ twin" over its twin's.
The receiver's buffer is touched before it is registered (a real cache is resident), and each
side is one buffer reused by every case.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rank_worker.kv.kv_transfer import KVRegion, KVTransferEngine, write_descriptors
from rank_worker.kv.pd_staging import HostStaging, StagingCopier
from shm_ipc.block_copies import DEVICE_TIER, STAGING_TIER, BlockCopy

HOST = "127.0.0.1"
MIB = 1 << 20
GIB = 1 << 30
# (buffers, bytes each): large contiguous writes, then many small ones (the scattered path's).
RAW = [(64, MIB), (16, 4 * MIB), (1000, 32 << 10)]
RAW_REFERENCE = RAW[:2]  # the ratio's denominator: the best of these
# Qwen3-0.6B: 28 layers, 8 KV heads of 128; bf16, blocks of 16 tokens.
LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 28, 8, 128, 16
SRC_SPARE, DST_SPARE = 2, 3  # cache sizes as multiples of the prompt's blocks


def cache_shape(num_blocks: int, tp: int) -> tuple[int, ...]:
    return (LAYERS, 2, num_blocks, BLOCK_SIZE, KV_HEADS // tp, HEAD_DIM)


def nbytes_of(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape)) * 2  # bf16


def receiver(conn: Any, nbytes: int) -> None:
    """Holds one registered buffer; answers `("cache", shape)` with the region of a bf16 cache
    of that shape laid over it, until `("quit",)`."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(0)  # resident pages: a real cache is, and first touches would be timed otherwise
    with KVTransferEngine(HOST) as engine:
        engine.register(buf)
        conn.send((engine.session_id, buf.data_ptr()))
        while (msg := conn.recv())[0] == "cache":
            view = buf[: nbytes_of(msg[1])].view(torch.bfloat16).view(msg[1])
            conn.send(KVRegion.of_cache(view).to_wire())


def timed_rounds(fns: list[Callable[[], Any]], repeats: int) -> list[list[float]]:
    """Seconds of each of `fns`, `repeats` times, in rounds (one run of each per round), so
    that the load of a shared machine drifting during the run falls on every case alike."""
    for fn in fns:
        fn()  # warm-up: the first write to a peer also makes the connection
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, secs in zip(fns, out, strict=True):
            start = time.perf_counter()
            fn()
            secs.append(time.perf_counter() - start)
    return out


def rates(nbytes: int, seconds: list[float]) -> dict[str, float]:
    return {
        "median_gib_s": round(nbytes / statistics.median(seconds) / GIB, 3),
        "best_gib_s": round(nbytes / min(seconds) / GIB, 3),
        "median_ms": round(statistics.median(seconds) * 1e3, 2),
    }


def kv_cases(prompts: list[int], seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    cases = []
    for tokens in prompts:
        n = -(-tokens // BLOCK_SIZE)
        for tp in (1, 2):
            for pattern in ("contiguous", "scattered", "staged"):
                if pattern == "contiguous":
                    src, dst = np.arange(n), np.arange(n, 2 * n)
                elif pattern == "staged":  # scattered in the sender's cache, to slots 0..n-1
                    src, dst = rng.choice(SRC_SPARE * n, n, replace=False), np.arange(n)
                else:
                    src = rng.choice(SRC_SPARE * n, n, replace=False)
                    dst = rng.choice(DST_SPARE * n, n, replace=False)
                cases.append({"tokens": tokens, "tp": tp, "pattern": pattern, "blocks": n,
                              "src": src.tolist(), "dst": dst.tolist()})  # fmt: skip
    return cases


def raw_runs(engine: KVTransferEngine, peer: str, src_ptr: int, dst_ptr: int) -> list[dict]:
    """One row per `RAW` shape, each with the write it times under "fn"."""
    rows = []
    for count, size in RAW:
        srcs = [src_ptr + i * size for i in range(count)]
        dsts = [dst_ptr + i * size for i in range(count)]
        lengths = [size] * count
        write = functools.partial(engine.write, peer, srcs, dsts, lengths)
        rows.append({"buffers": count, "buffer_bytes": size, "fn": write})
    return rows


def twin_write(
    engine: KVTransferEngine, peer: str, src_ptr: int, dst_ptr: int, lengths: list[int]
) -> Callable[[], None]:
    """The raw write of the same shape as a KV case (as many transfers, as long), over
    consecutive addresses: what the KV case costs beyond Mooncake's own cost per transfer."""
    offsets = np.concatenate(([0], np.cumsum(lengths[:-1]))).tolist()
    srcs = [src_ptr + o for o in offsets]
    dsts = [dst_ptr + o for o in offsets]
    return functools.partial(engine.write, peer, srcs, dsts, lengths)


def copy_in_seconds(n: int, tp: int, repeats: int, seed: int) -> list[float]:
    """A decode rank's copy of `n` staged slots (a run, as its rank 0 hands them out) into
    scattered blocks of its cache: `StagingCopier` as a step plan runs it, timed here."""
    cache = torch.zeros(cache_shape(DST_SPARE * n, tp), dtype=torch.bfloat16)
    staging = HostStaging(cache, n)
    staging.pool.fill_(1)
    copier = StagingCopier(staging, [(cache[i, 0], cache[i, 1]) for i in range(LAYERS)], None)
    dst = np.random.default_rng(seed).choice(DST_SPARE * n, n, replace=False).astype(np.int32)
    copy = BlockCopy(STAGING_TIER, DEVICE_TIER, np.arange(n, dtype=np.int32), dst)
    return timed_rounds([functools.partial(copier.before_forward, [copy], True)], repeats)[0]


def kv_row(case: dict, secs: list[float], twin: list[float], reference: float) -> dict[str, Any]:
    src, dst, lengths = case["src_region"], case["dst_region"], case["lengths"]
    build = timed_rounds(
        [functools.partial(write_descriptors, src, dst, case["src"], case["dst"])], 5
    )
    row = {k: case[k] for k in ("tokens", "tp", "pattern", "blocks")}
    moved = sum(lengths)
    row.update(transfers=len(lengths), transfer_bytes=lengths[0], kv_bytes=moved,
               descriptors_ms=round(statistics.median(build[0]) * 1e3, 2), **rates(moved, secs))  # fmt: skip
    row["ratio_to_raw"] = round(row["median_gib_s"] / reference, 3)
    row["same_shape_raw"] = rates(moved, twin)
    row["ratio_to_same_shape"] = round(
        row["median_gib_s"] / row["same_shape_raw"]["median_gib_s"], 3
    )
    if "copy_in" in case:
        row["decode_copy_in_ms"] = round(statistics.median(case["copy_in"]) * 1e3, 2)
    return row


def measure(prompts: list[int], repeats: int, seed: int) -> dict[str, Any]:
    largest = max(prompts) // BLOCK_SIZE + 1
    src_bytes = max(nbytes_of(cache_shape(SRC_SPARE * largest, 1)), max(n * s for n, s in RAW))
    dst_bytes = max(nbytes_of(cache_shape(DST_SPARE * largest, 1)), max(n * s for n, s in RAW))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child, dst_bytes), daemon=True)
    proc.start()
    src_buf = torch.empty(src_bytes, dtype=torch.uint8)
    src_buf.fill_(1)
    try:
        if not parent.poll(120):
            raise RuntimeError("the receiver did not start in 120 s")
        peer, dst_ptr = parent.recv()
        with KVTransferEngine(HOST) as engine:
            engine.register(src_buf)
            raw, kv = raw_runs(engine, peer, src_buf.data_ptr(), dst_ptr), []
            fns = [r.pop("fn") for r in raw]
            for case in kv_cases(prompts, seed):
                n, tp = case["blocks"], case["tp"]
                shape = cache_shape(SRC_SPARE * n, tp)
                src = KVRegion.of_cache(
                    src_buf[: nbytes_of(shape)].view(torch.bfloat16).view(shape)
                )
                parent.send(("cache", cache_shape(DST_SPARE * n, tp)))
                dst = KVRegion.from_wire(parent.recv())
                if case["pattern"] == "staged":
                    cache = src_buf[: nbytes_of(shape)].view(torch.bfloat16).view(shape)
                    staging = HostStaging(cache, n)
                    engine.register(staging.pool)
                    lengths = write_descriptors(staging.region, dst, range(n), case["dst"])[2]
                    write = functools.partial(staging.send, engine, peer, dst, case["src"],
                                              case["dst"])  # fmt: skip
                    case["copy_in"] = copy_in_seconds(n, tp, repeats, seed)
                else:
                    lengths = write_descriptors(src, dst, case["src"], case["dst"])[2]
                    write = functools.partial(
                        engine.write_blocks, peer, src, dst, case["src"], case["dst"]
                    )
                kv.append({**case, "src_region": src, "dst_region": dst, "lengths": lengths})
                fns.append(write)
                fns.append(twin_write(engine, peer, src_buf.data_ptr(), dst_ptr, lengths))
            times = timed_rounds(fns, repeats)
        for r, secs in zip(raw, times, strict=False):
            r.update(rates(r["buffers"] * r["buffer_bytes"], secs))
        reference = max(r["median_gib_s"] for r in raw[: len(RAW_REFERENCE)])
        pairs = times[len(raw) :]
        kv = [kv_row(c, pairs[2 * i], pairs[2 * i + 1], reference) for i, c in enumerate(kv)]
        parent.send(("quit",))
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
    return {"repeats": repeats, "raw_reference_gib_s": reference, "raw": raw, "kv": kv}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, nargs="+", default=[1024, 4096], help="prompt tokens")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0, help="the scattered blocks")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    print(f"load average {os.getloadavg()}", flush=True)
    result = measure(args.prompts, args.repeats, args.seed)
    print(f"\n{'case':<32} {'GiB/s med':>9} {'best':>6} {'ms med':>8} {'transfers':>9} "
          f"{'descr ms':>8} {'/ raw':>6} {'twin GiB/s':>10} {'/ twin':>6}")  # fmt: skip
    for r in result["raw"]:
        name = f"raw {r['buffers']} x {r['buffer_bytes'] // 1024} KiB"
        print(f"{name:<32} {r['median_gib_s']:>9} {r['best_gib_s']:>6} {r['median_ms']:>8} "
              f"{r['buffers']:>9}")  # fmt: skip
    for r in result["kv"]:
        name = f"kv {r['tokens']} tok TP {r['tp']} {r['pattern']}"
        print(f"{name:<32} {r['median_gib_s']:>9} {r['best_gib_s']:>6} {r['median_ms']:>8} "
              f"{r['transfers']:>9} {r['descriptors_ms']:>8} {r['ratio_to_raw']:>6} "
              f"{r['same_shape_raw']['median_gib_s']:>10} {r['ratio_to_same_shape']:>6}"
              + (f"  copy in {r['decode_copy_in_ms']} ms" if "decode_copy_in_ms" in r else ""))  # fmt: skip
    if args.output_json:
        from benchmarks.results import environment, write_json

        write_json(args.output_json, {"environment": environment(), **result})
    print(f"load average {os.getloadavg()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
