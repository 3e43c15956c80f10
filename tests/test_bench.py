"""The benchmark library (workload, limit model, serving metrics, control-plane timing) and the
`launch/bench*.py` entry points end to end on the demo model, on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.control_plane import load_engine as control_plane_engine
from benchmarks.control_plane import time_decode_steps
from benchmarks.limits import ModelShape, Peaks, decode_steps, offline_limit, peaks_for
from benchmarks.serving_client import (
    RequestResult,
    compute_metrics,
    format_result_block,
    random_requests,
)
from benchmarks.workload import NANO_VLLM_OUTPUT_TOKENS, random_workload
from tests.server_harness import REPO_ROOT, Server
from tp_engine.common.step_timeline import StepTimeline

# -- workload -----------------------------------------------------------------------------------


def test_default_workload_is_nano_vllms():
    w = random_workload()
    assert w.num_seqs == 256
    assert w.num_output_tokens == NANO_VLLM_OUTPUT_TOKENS == 133_966
    assert all(100 <= n <= 1024 for n in w.prompt_lens + w.output_lens)
    assert all(0 <= t <= 10_000 for p in w.prompt_token_ids for t in p)


def test_small_vocab_folds_ids_but_keeps_lengths():
    w, folded = random_workload(num_seqs=8), random_workload(num_seqs=8, vocab_size=640)
    assert folded.output_lens == w.output_lens and folded.prompt_lens == w.prompt_lens
    assert max(t for p in folded.prompt_token_ids for t in p) < 640


# -- limit model ----------------------------------------------------------------------------------

# hidden 8, 2 layers, 2 query heads and 1 KV head of 4, MLP 16, vocab 32, untied head.
TINY = ModelShape(8, 2, 2, 1, 4, 16, 32, False)


def test_tiny_shape_counts_by_hand():
    # qkv 8*(2+2)*4 = 128, o 2*4*8 = 64, gate/up/down 3*8*16 = 384.
    assert TINY.linear_params_per_layer == 576
    # 2 layers of 576, norms 2*(8+8+4+4) + 8 = 56, head 256, embedding 256.
    assert TINY.weight_params == 1152 + 56 + 256 + 256
    tied = ModelShape(8, 2, 2, 1, 4, 16, 32, True)
    assert tied.weight_params == 1152 + 56 + 256
    assert TINY.kv_values_per_token == 2 * 2 * 1 * 4
    # P = 3: linear 2*3*2*576 = 6912; 6 causal pairs * 4*2 layers*2 heads*4 = 384; head 2*256.
    assert TINY.prefill_flops(3) == 6912 + 384 + 512
    # context 4: 2*(1152 + 256) + 4*2*2*4*4.
    assert TINY.decode_flops(4) == 2816 + 256


def test_decode_steps_follow_continuous_batching():
    # One slot: A (P=3, O=3) decodes tokens 2 and 3 over KV 4 then 5; then B (P=2, O=2) over 3.
    assert decode_steps([3, 2], [3, 2], max_num_seqs=1) == [(1, 4), (1, 5), (1, 3)]
    # Two slots: both at once, B finishes after one step.
    assert decode_steps([3, 2], [3, 2], max_num_seqs=2) == [(2, 7), (1, 5)]
    # One output token comes from the prefill alone.
    assert decode_steps([3, 2], [3, 1], max_num_seqs=1) == [(1, 4), (1, 5)]


def test_offline_limit_by_hand():
    limit = offline_limit(
        TINY, [3, 2], [3, 2], max_num_seqs=2, bytes_per_value=2,
        peaks=Peaks(1000.0, 100.0, "test"), tp_size=2,
    )  # fmt: skip
    assert limit.prefill_flops == 7808 + 5312
    assert limit.decode_flops == 3072 + 3136 + 3008
    assert limit.num_decode_steps == 2
    assert limit.decode_weight_bytes == 2 * 1720 * 2
    assert limit.decode_kv_bytes == (7 + 5) * 16 * 2
    assert limit.prefill_time_s == pytest.approx(13120 / 2000)
    assert limit.decode_time_s == pytest.approx((6880 + 384) / 200)
    assert limit.time_s == pytest.approx(6.56 + 36.32)


def test_peaks():
    assert peaks_for("NVIDIA H200").flops_per_s == 989e12
    assert peaks_for("NVIDIA H200").bytes_per_s == 4.8e12
    assert "nominal" in peaks_for("cpu (x86_64)").source


# -- serving metrics ----------------------------------------------------------------------------


def test_serving_metrics_and_block():
    results = [
        RequestResult(True, 10, 3, ttft_s=0.1, latency_s=0.3, itl_s=[0.1, 0.1], chunks=3),
        RequestResult(True, 20, 1, ttft_s=0.2, latency_s=0.2, itl_s=[], chunks=1),
        RequestResult(False, error="boom"),
    ]
    m = compute_metrics(results, duration_s=2.0)
    assert (m.completed, m.failed, m.total_input, m.total_output) == (2, 1, 30, 4)
    assert m.request_throughput == 1.0 and m.output_throughput == 2.0
    assert m.total_token_throughput == 17.0
    assert m.ttft_ms["mean"] == pytest.approx(150.0)
    assert m.tpot_ms["mean"] == pytest.approx(100.0)  # only the request with > 1 token
    assert m.itl_ms["median"] == pytest.approx(100.0)
    block = format_result_block(m, max_concurrency=4, request_rate=float("inf"))
    for line in ("Serving Benchmark Result", "Successful requests:", "Benchmark duration (s):",
                 "Total generated tokens:", "Output token throughput (tok/s):",
                 "Total Token throughput (tok/s):", "P99 TTFT (ms):", "Median TPOT (ms):",
                 "Mean ITL (ms):"):  # fmt: skip
        assert line in block


def test_random_requests_are_reproducible():
    a = random_requests(5, 32, 8, range_ratio=0.5, vocab_size=100, seed=1)
    assert a == random_requests(5, 32, 8, range_ratio=0.5, vocab_size=100, seed=1)
    assert all(16 <= r.prompt_len <= 48 and 4 <= r.output_len <= 12 for r in a)
    assert all(max(r.prompt) < 100 for r in a)


# -- control plane ------------------------------------------------------------------------------


def test_control_plane_timing_small():
    t = time_decode_steps(control_plane_engine(REPO_ROOT), 8, 20, 3, block_size=4)
    assert t["num_seqs"] == 8 and t["num_steps"] == 3
    assert t["rank0_us"]["median"] > 0 and t["worker_us"]["median"] > 0
    # 8 decodes, their tables sent earlier: the header, 5 arrays of at most 9 ints, and at
    # most one appended block per sequence (rows, starts, offsets and the block ids).
    assert 40 < t["plan_bytes"]["max"] <= 40 + 4 * 5 * 9 + 4 * (8 + 8 + 9 + 8)


# -- entry points end to end ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench_env(tmp_path_factory):
    env = dict(os.environ, TP_ENGINE_CACHE=str(tmp_path_factory.mktemp("cache")))
    env.pop("TP_ENGINE_FAULT", None)
    return env


def _run(args: list[str], env: dict[str, str]) -> str:
    proc = subprocess.run(
        [sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.slow
def test_bench_py_end_to_end(bench_env, tmp_path):
    out, timeline_json = tmp_path / "bench.json", tmp_path / "timeline.json"
    stdout = _run(
        ["launch/bench.py", "--num-seqs", "4", "--min-input-len", "8", "--max-input-len", "16",
         "--min-output-len", "4", "--max-output-len", "8", "--peak-tflops", "1",
         "--peak-bandwidth-gbs", "50", "--output-json", str(out),
         "--step-timeline", str(timeline_json)],
        bench_env,
    )  # fmt: skip
    assert "Fraction of limit:" in stdout
    r = json.loads(out.read_text())
    workload = random_workload(4, 8, 16, 4, 8)
    assert r["workload"]["output_tokens"] == sum(workload.output_lens)
    assert r["output_tokens_per_s"] > 0 and r["fraction_of_limit"] > 0
    assert r["peaks"] == {"flops_per_s": 1e12, "bytes_per_s": 50e9, "source": "command-line flags"}
    assert r["device_kind"] in ("cpu", "cuda") and r["torch"] and "commit" in r
    # Start-up time, by phase (no CUDA graphs on CPU).
    startup = r["startup_s"]
    assert startup["total"] >= startup["load"] + startup["profile"] > 0
    assert startup["cuda_graph_sizes"] == [] and startup["num_kv_blocks"] > 0
    assert r["triton_binaries"] == {"after_startup": {}, "after_run": {}}  # CPU: torch path
    assert "Start-up:" in stdout

    # The step timeline: its own file (metadata, summary, records) and the summary in the result.
    t = json.loads(timeline_json.read_text())
    assert t["benchmark"] == "step_timeline" and t["result_json"] == str(out)
    assert t["workload"] == r["workload"] and t["elapsed_s"] == r["elapsed_s"]
    assert r["step_timeline"] == str(timeline_json)
    assert r["step_timeline_summary"] == t["summary"]
    phases_by_step: dict[int, dict[str, float]] = {}
    for step_id, phase, start_s, end_s in t["records"]:
        assert 0 <= start_s <= end_s <= r["elapsed_s"] + 1.0
        phases_by_step.setdefault(step_id, {}).setdefault(phase, start_s)
    # Every token of the longest request comes from its own step (needs the engine's hook).
    assert len(phases_by_step) >= max(workload.output_lens), "the engine recorded no steps"
    for step_id, first_start in phases_by_step.items():
        assert {"schedule", "forward", "sample"} <= first_start.keys(), (step_id, first_start)
        assert first_start["schedule"] <= first_start["forward"] <= first_start["sample"]
    assert t["summary"]["forward"]["count"] == len(phases_by_step)
    png = tmp_path / "timeline.png"
    _run(["launch/plot.py", "timeline", str(out), "-o", str(png)], bench_env)  # via the result
    assert png.stat().st_size > 0


@pytest.mark.slow
def test_plot_timeline_of_a_hand_made_timeline(bench_env, tmp_path):
    tl = StepTimeline()
    for step in range(5, 45):  # a bench's timed run starts after the warm-up's steps
        t = step * 1e-3
        for i, phase in enumerate(("schedule", "build_plan", "forward", "sample", "update")):
            tl.record(step, phase, t + i * 1e-4, t + (i + 1) * 1e-4)
    path = tmp_path / "timeline.json"
    path.write_text(json.dumps({"benchmark": "step_timeline", **tl.to_dict()}))
    for i, steps in enumerate(([], ["--steps", "10:15"], ["--steps", ":8"])):
        png = tmp_path / f"timeline{i}.png"
        _run(["launch/plot.py", "timeline", str(path), "-o", str(png), *steps], bench_env)
        assert png.stat().st_size > 0


@pytest.mark.slow
def test_bench_control_plane_script(bench_env, tmp_path):
    out = tmp_path / "cp.json"
    stdout = _run(
        ["launch/bench_control_plane.py", "--num-seqs", "4", "8", "--num-steps", "3",
         "--prompt-len", "16", "--output-json", str(out)],
        bench_env,
    )  # fmt: skip
    assert "rank 0" in stdout
    result = json.loads(out.read_text())
    assert [row["num_seqs"] for row in result["after"]["results"]] == [4, 8]


@pytest.mark.slow
def test_bench_serving_against_demo_server(bench_env, tmp_path):
    srv = Server(
        [sys.executable, "launch/serve.py", "--port", "0", "--max-model-len", "256",
         "--num-kv-blocks", "64"],
        bench_env,
        tmp_path / "server.log",
    )  # fmt: skip
    try:
        srv.wait_ready()
        out = tmp_path / "serving.json"
        stdout = _run(
            ["launch/bench_serving.py", "--base-url", f"http://{srv.host}:{srv.port}",
             "--num-prompts", "6", "--random-input-len", "16", "--random-output-len", "8",
             "--random-vocab-size", "600", "--request-rate", "50", "--max-concurrency", "4",
             "--output-json", str(out)],
            bench_env,
        )  # fmt: skip
    finally:
        srv.stop()
    assert "Serving Benchmark Result" in stdout and "Mean TTFT (ms):" in stdout
    r = json.loads(out.read_text())
    assert r["completed"] == 6 and r["failed"] == 0
    assert r["total_output"] == 6 * 8 and r["total_input"] == 6 * 16
    assert r["ttft_ms"]["mean"] > 0 and len(r["ttfts_s"]) == 6
    png = tmp_path / "latency.png"  # matplotlib comes with the dev extra
    _run(["launch/plot.py", "latency", str(out), "-o", str(png)], bench_env)
    assert png.stat().st_size > 0


def test_random_requests_as_text_are_words_one_per_asked_token():
    a = random_requests(4, 20, 8, range_ratio=0.5, vocab_size=50, seed=3, as_text=True)
    assert a == random_requests(4, 20, 8, range_ratio=0.5, vocab_size=50, seed=3, as_text=True)
    ids = random_requests(4, 20, 8, range_ratio=0.5, vocab_size=50, seed=3)
    for text, tokens in zip(a, ids, strict=True):
        assert isinstance(text.prompt, str) and text.prompt.split() == [
            f"w{i}" for i in tokens.prompt
        ]
        assert text.prompt_len == tokens.prompt_len and text.output_len == tokens.output_len


def test_itl_is_per_token_and_sparse_chunks_refuse_per_token_timing():
    # Request 1: 4 tokens in 3 chunks (the last carries 2): ITL has 3 entries, the 0.2 s gap
    # split over its 2 tokens.
    a = RequestResult(True, 5, 4, ttft_s=0.1, latency_s=0.5, itl_s=[0.2, 0.1, 0.1], chunks=3)
    m = compute_metrics([a], duration_s=1.0)
    assert m.streamed_chunks == 3 and m.chunk_coverage == pytest.approx(0.75)
    assert m.per_token_timing_refused is None
    assert m.itl_ms["mean"] == pytest.approx(400 / 3) and m.tpot_ms["mean"] == pytest.approx(
        400 / 3
    )
    # Request 2: 64 tokens, one text chunk at the end (ids without text): TTFT is reported,
    # TPOT and ITL are refused with the reason, in the block too.
    b = RequestResult(True, 5, 64, ttft_s=0.9, latency_s=0.9, itl_s=[], chunks=1)
    m = compute_metrics([b], duration_s=1.0)
    assert m.tpot_ms is None and m.itl_ms is None
    assert "1 streamed chunks that carried text cover 1.6% of the 64 output tokens" in (
        m.per_token_timing_refused
    )
    block = format_result_block(m, max_concurrency=None, request_rate=float("inf"))
    assert (
        "Mean TTFT (ms):" in block and "Mean TPOT" not in block and "TPOT and ITL refused" in block
    )
    # The threshold is the caller's (multi-token chunks of speculative decoding).
    assert compute_metrics([b], 1.0, min_chunk_coverage=0.01).tpot_ms is not None


def test_send_request_counts_each_chunks_tokens_from_the_running_usage():
    """A scripted SSE stream: 5 tokens in chunks of 1, 3 (two without text folded into the
    next) and 1; ITL gets one entry per token after the first chunk."""
    import asyncio

    from benchmarks.serving_client import Request, send_request

    def event(text, completion_tokens, finish=None):
        body = {"choices": [{"text": text, "finish_reason": finish}],
                "usage": {"prompt_tokens": 3, "completion_tokens": completion_tokens}}  # fmt: skip
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    stream = [event("a", 1), event("", 2), event("", 3), event("bcd", 4), event("e", 5, "length"),
              b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}\n\n',
              b"data: [DONE]\n\n"]  # fmt: skip
    seen = {}

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(v for k, v in (
            line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line
        ) if k.strip().lower() == b"content-length"))  # fmt: skip
        seen["body"] = json.loads(await reader.readexactly(length))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
        for chunk in stream:
            writer.write(chunk)
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await send_request(f"http://127.0.0.1:{port}", "m", Request([1, 2, 3], 3, 5))

    r = asyncio.run(main())
    assert seen["body"]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert r.success and (r.output_len, r.chunks, r.prompt_len) == (5, 3, 3)
    assert len(r.itl_s) == 4  # tokens 2..5: three from the "bcd" chunk, one from "e"
    # The "bcd" chunk came three 20 ms sleeps after "a": that gap, split over its 3 tokens.
    assert r.itl_s[0] == r.itl_s[1] == r.itl_s[2] and 3 * r.itl_s[0] >= 0.055


def _serve_and_bench(model: Path, env, tmp_path: Path, tag: str) -> dict:
    srv = Server(
        [sys.executable, "launch/serve.py", "--model", str(model), "--port", "0",
         "--max-model-len", "256", "--num-kv-blocks", "64"],
        env,
        tmp_path / f"server-{tag}.log",
    )  # fmt: skip
    try:
        srv.wait_ready()
        out = tmp_path / f"serving-{tag}.json"
        _run(
            ["launch/bench_serving.py", "--base-url", f"http://{srv.host}:{srv.port}",
             "--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "24",
             "--random-vocab-size", "600", "--max-concurrency", "4", "--output-json", str(out)],
            env,
        )  # fmt: skip
    finally:
        srv.stop()
    return json.loads(out.read_text())


@pytest.mark.slow
def test_serving_benchmark_needs_a_tokenizer_that_covers_the_vocabulary(bench_env, tmp_path):
    """The same tiny model under Qwen3's 151,936 rows, with Qwen3's tokenizer (151,669 tokens)
    and with the 640-token test one: the first streams a chunk per token and gets TPOT and
    ITL; under the second almost every sampled id has no text, and they are refused."""
    from tp_engine.testing import QWEN3_VOCAB_ROWS, build_random_qwen3

    shape = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                 intermediate_size=64, vocab_size=QWEN3_VOCAB_ROWS, max_position_embeddings=256)  # fmt: skip
    covering = build_random_qwen3(tmp_path / "qwen3-tok", tokenizer="qwen3", **shape)
    sparse = build_random_qwen3(tmp_path / "test-tok", tokenizer="test", **shape)
    good = _serve_and_bench(covering, bench_env, tmp_path, "covering")
    bad = _serve_and_bench(sparse, bench_env, tmp_path, "sparse")
    assert good["completed"] == bad["completed"] == 4
    assert good["total_output"] == bad["total_output"] == 4 * 24
    assert good["chunk_coverage"] > 0.8 and good["per_token_timing_refused"] is None
    assert good["tpot_ms"]["mean"] > 0 and good["itl_ms"]["mean"] > 0
    assert bad["chunk_coverage"] < 0.2
    assert bad["tpot_ms"] is None and bad["itl_ms"] is None
    assert "cover" in bad["per_token_timing_refused"]
