"""Load generation against an OpenAI-compatible server and vLLM's serving metrics.

Owns: the request list (random token-id or word prompts, or a ShareGPT-format file), the arrival
schedule (Poisson or all at once), one streamed `/v1/completions` request over a plain asyncio
socket (standard library only: HTTP/1.1, chunked or not, server-sent events), and the metric
definitions, which follow vLLM's `benchmark_serving.py`:

- TTFT: request sent -> first streamed chunk that carries text or tokens;
- ITL: per token: the gap before each later chunk, split evenly over the tokens it carries
  (SGLang's bench_serving does the same for multi-token chunks);
- TPOT: (latency - TTFT) / (output tokens - 1), per request with more than one token;
- throughputs over the wall time of the whole run.

Tokens are counted, not chunks: every request asks for vLLM's `continuous_usage_stats`, so each
chunk carries the running `completion_tokens` and its own token count is the difference. When
the text-bearing chunks are far fewer than the tokens (`MIN_CHUNK_COVERAGE`: tokens without
text, e.g. a tokenizer that covers a fraction of the model's rows, arrive folded into a later
chunk or not at all), per-token timing was not observed, and ITL and TPOT are refused, not
reported.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np


@dataclass(frozen=True)
class Request:
    # Text or token ids, sent as the completion's `prompt` as is.
    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    # Per token after the first chunk: the gap before its chunk / the tokens in that chunk.
    itl_s: list[float] = field(default_factory=list)
    # Streamed chunks that carried text (or a finish reason).
    chunks: int = 0
    error: str = ""
    # The response's `id` (the server's request id), and when the request was sent and its
    # first chunk read on `time.perf_counter()`'s clock (CLOCK_MONOTONIC on Linux, the clock of
    # the server's request traces, `tp_engine.server.request_trace`).
    response_id: str = ""
    sent_at_s: float = 0.0
    first_chunk_at_s: float = 0.0


# -- datasets -------------------------------------------------------------------------------


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    vocab_size: int = 10_000,
    seed: int = 0,
    as_text: bool = False,
) -> list[Request]:
    """Token-id prompts of lengths uniform in input_len * [1 - r, 1 + r] (vLLM's random set).
    `as_text`: the same number of random words instead (of `vocab_size` made-up words), for
    servers that take only text prompts, such as sglang-router; the token count is then the
    server's (its usage), not the word count."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(vocab_size)] if as_text else []

    def length(n: int) -> int:
        return rng.randint(max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio))))

    out = []
    for _ in range(num_prompts):
        ids = [rng.randrange(vocab_size) for _ in range(length(input_len))]
        prompt: str | list[int] = " ".join(words[i] for i in ids) if as_text else ids
        out.append(Request(prompt, len(ids), length(output_len)))
    return out


def sharegpt_requests(
    path: str, num_prompts: int, output_len: int | None = None, seed: int = 0
) -> list[Request]:
    """First-turn human prompts of a ShareGPT-format JSON file (`[{"conversations": [{"from",
    "value"}, ...]}]`). Without a tokenizer at hand, lengths are counted in whitespace words;
    `output_len` None asks for as many tokens as the recorded reply has words."""
    with open(path) as f:
        data = json.load(f)
    rng = random.Random(seed)
    rng.shuffle(data)
    out = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, reply = turns[0]["value"], turns[1]["value"]
        n_out = output_len or max(1, len(reply.split()))
        out.append(Request(prompt, max(1, len(prompt.split())), n_out))
        if len(out) == num_prompts:
            break
    if not out:
        raise ValueError(f"{path}: no conversation with a prompt and a reply")
    return out


async def arrivals(
    requests: Sequence[Request], request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> AsyncIterator[Request]:
    """Yield requests at `request_rate` per second: gamma-distributed gaps (Poisson when
    burstiness is 1), or all at once when the rate is infinite."""
    rng = np.random.default_rng(seed)
    for req in requests:
        yield req
        if request_rate != float("inf"):
            theta = 1.0 / (request_rate * burstiness)
            await asyncio.sleep(float(rng.gamma(shape=burstiness, scale=theta)))


# -- one streamed request ---------------------------------------------------------------------


async def _http_post_stream(
    url: str, body: dict[str, Any], headers: dict[str, str]
) -> AsyncIterator[bytes]:
    """POST `body` as JSON and yield the response body as it arrives (chunked or not)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    reader, writer = await asyncio.open_connection(host, port)
    try:
        payload = json.dumps(body).encode()
        head = [
            f"POST {parts.path or '/'} HTTP/1.1",
            f"Host: {host}:{port}",
            "Content-Type: application/json",
            "Accept: text/event-stream",
            f"Content-Length: {len(payload)}",
            "Connection: close",
            *(f"{k}: {v}" for k, v in headers.items()),
        ]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        await writer.drain()
        status_line = await reader.readline()
        status = int(status_line.split()[1])
        resp_headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            key, _, value = line.decode().partition(":")
            resp_headers[key.strip().lower()] = value.strip()
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {(await reader.read())[:500]!r}")
        if resp_headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    break
                yield await reader.readexactly(size)
                await reader.readline()  # the CRLF after each chunk
        else:
            while chunk := await reader.read(65536):
                yield chunk
    finally:
        writer.close()


async def send_request(
    base_url: str, model: str, req: Request, api_key: str | None = None, ignore_eos: bool = True
) -> RequestResult:
    """One streamed completion, timed per chunk."""
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": ignore_eos,
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    result = RequestResult(prompt_len=req.prompt_len)
    start = last = time.perf_counter()
    result.sent_at_s = start
    chunks = 0
    usage_tokens = None
    counted = 0  # completion tokens up to the last text-bearing chunk
    buffer = b""
    try:
        async for data in _http_post_stream(
            base_url.rstrip("/") + "/v1/completions", body, headers
        ):
            buffer += data
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                line = event.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[len(b"data:") :].strip()
                if payload == b"[DONE]":
                    continue
                obj = json.loads(payload)
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                    # The server's count of a text prompt's tokens beats our word count.
                    result.prompt_len = obj["usage"].get("prompt_tokens") or result.prompt_len
                choices = obj.get("choices") or []
                if not choices or not (choices[0].get("text") or choices[0].get("finish_reason")):
                    continue
                now = time.perf_counter()
                # This chunk's tokens: the running count's step (1 without running counts).
                tokens = max(1, usage_tokens - counted) if usage_tokens is not None else 1
                counted += tokens
                if chunks == 0:
                    result.ttft_s = now - start
                    result.first_chunk_at_s = now
                    result.response_id = str(obj.get("id", ""))
                else:
                    result.itl_s += [(now - last) / tokens] * tokens
                last = now
                chunks += 1
        result.latency_s = time.perf_counter() - start
        result.output_len = usage_tokens if usage_tokens is not None else chunks
        result.chunks = chunks
        result.success = chunks > 0
        if not result.success:
            result.error = "no streamed chunk"
    except Exception as exc:  # a failed request is counted, not fatal
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_benchmark(
    base_url: str,
    model: str,
    requests: Sequence[Request],
    request_rate: float = float("inf"),
    max_concurrency: int | None = None,
    api_key: str | None = None,
    burstiness: float = 1.0,
    seed: int = 0,
) -> tuple[list[RequestResult], float]:
    """Send every request on schedule; returns the results (in request order) and the wall time."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(req: Request) -> RequestResult:
        if limit is None:
            return await send_request(base_url, model, req, api_key)
        async with limit:
            return await send_request(base_url, model, req, api_key)

    start = time.perf_counter()
    tasks = [
        asyncio.create_task(one(req))
        async for req in arrivals(requests, request_rate, burstiness, seed)
    ]
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


# -- metrics ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServingMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input: int
    total_output: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    # Milliseconds: mean, median, p99 of each. TPOT and ITL are None when refused (see
    # `per_token_timing_refused`).
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float] | None
    itl_ms: dict[str, float] | None
    # Text-bearing streamed chunks, and their number per output token.
    streamed_chunks: int = 0
    chunk_coverage: float = 0.0
    # Why TPOT and ITL are not reported; None when they are.
    per_token_timing_refused: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _stats(values_s: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if ms.size == 0:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0, "std": 0.0}
    return {
        "mean": float(ms.mean()),
        "median": float(np.median(ms)),
        "p99": float(np.percentile(ms, 99)),
        "std": float(ms.std()),
    }


# Below this many text-bearing chunks per output token, the stream did not show when tokens were
# made: ITL and TPOT are refused. A token-per-chunk stream is 1.0; a tokenizer that covers the
# model's vocabulary loses a few percent to ids whose bytes end inside a character; speculative
# decoding (several tokens a step) would need this lowered.
MIN_CHUNK_COVERAGE = 0.5


def compute_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    min_chunk_coverage: float = MIN_CHUNK_COVERAGE,
) -> ServingMetrics:
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    chunks = sum(r.chunks for r in ok)
    coverage = chunks / total_output if total_output else 0.0
    refused = None
    if total_output and coverage < min_chunk_coverage:
        refused = (
            f"the {chunks} streamed chunks that carried text cover {coverage:.1%} of the "
            f"{total_output} output tokens the server's usage counts (below "
            f"{min_chunk_coverage:.0%}): most tokens arrived without text or folded into a later "
            "chunk, so the time between tokens was not observed. Serve a checkpoint whose "
            "tokenizer covers its vocabulary (the size presets do)."
        )
    tpots = [(r.latency_s - r.ttft_s) / (r.output_len - 1) for r in ok if r.output_len > 1]
    return ServingMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        ttft_ms=_stats([r.ttft_s for r in ok]),
        tpot_ms=None if refused else _stats(tpots),
        itl_ms=None if refused else _stats([gap for r in ok for gap in r.itl_s]),
        streamed_chunks=chunks,
        chunk_coverage=coverage,
        per_token_timing_refused=refused,
    )


def format_result_block(m: ServingMetrics, max_concurrency: int | None, request_rate: float) -> str:
    """vLLM's "Serving Benchmark Result" block, line for line."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append(f"{label:<40} {value:<10{fmt}}")

    row("Successful requests:", m.completed)
    if m.failed:
        row("Failed requests:", m.failed)
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if request_rate != float("inf"):
        row("Request rate configured (RPS):", request_rate, ".2f")
    row("Benchmark duration (s):", m.duration_s, ".2f")
    row("Total input tokens:", m.total_input)
    row("Total generated tokens:", m.total_output)
    row("Request throughput (req/s):", m.request_throughput, ".2f")
    row("Output token throughput (tok/s):", m.output_throughput, ".2f")
    row("Total Token throughput (tok/s):", m.total_token_throughput, ".2f")
    row("Streamed chunks per output token:", m.chunk_coverage, ".3f")
    for title, short, stats in (
        ("Time to First Token", "TTFT", m.ttft_ms),
        ("Time per Output Token (excl. 1st token)", "TPOT", m.tpot_ms),
        ("Inter-token Latency", "ITL", m.itl_ms),
    ):
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        if stats is None:
            row(f"{short}:", "not reported (see below)")
            continue
        row(f"Mean {short} (ms):", stats["mean"], ".2f")
        row(f"Median {short} (ms):", stats["median"], ".2f")
        row(f"P99 {short} (ms):", stats["p99"], ".2f")
    lines.append("=" * 50)
    if m.per_token_timing_refused:
        lines.append(f"TPOT and ITL refused: {m.per_token_timing_refused}")
    return "\n".join(lines)
