"""The API process's own work per request, without rank 0 or a socket: `api_parse`, `api_out`.

    python -m benchmarks.api_hops --output-json OUT.json [--requests 300] [--input-len 32]
        [--chat] [--text] [--gap-ms MS] [--profile OUT.prof]

Builds the real app (`tp_engine.server.api.app.build_app`) with Qwen3's tokenizer and drives
it as uvicorn would, one ASGI call per request, one request at a time, with
`TP_ENGINE_REQUEST_TRACE` set. Rank 0 is played in this process: the stub pipes decode each
AddRequest the app sends and answer, through the `EngineClient`'s own dispatcher, with
`accepted` at once (as `rank0.engine_loop` sends its verdicts before the step; with
`--accept-with-first-token` together with the first token, as it did before), the first token
1 ms later, then a token every 0.2 ms until `--output-len`,
the last with finish_reason "length"; every answer is an encoded `EngineOutputs` frame, so the
client's decode runs as it does in the server. The body is the serving client's
(`benchmarks.serving_client.send_request`): a streamed completion of token ids with continuous
usage, or with `--text` the same number of words, or with `--chat` one user message.

Per request, from the trace (`tp_engine.server.request_trace`): `api_parse` (route handler
starts -> AddRequest sent) and `api_out` (the dispatcher reads the first token -> first chunk
handed over), the two stages of `benchmarks/ttft_breakdown.py` that are the API process's alone.
Without HTTP, uvicorn and the ZeroMQ hop they are those stages minus scheduling noise of the
real server: what changes in the code shows here first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.ttft_breakdown import MODEL

_STATS = dict(
    num_running=1, num_waiting=0, kv_cache_usage=0.0, prefix_cache_queries=0,
    prefix_cache_hits=0, num_preemptions=0,
)  # fmt: skip


class LoopbackPipes:
    """Rank 0's side of the two pipes, in this process: every frame is encoded and decoded."""

    def __init__(self, output_len: int, accept_with_first_token: bool = False) -> None:
        self.output_len = output_len
        # Rank 0 before it sent its verdicts ahead of the step: `accepted` came with the first
        # token, so the response's set-up fell inside `api_out`.
        self.accept_with_first_token = accept_with_first_token
        self._inbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()  # made on the loop, before any request

    # The API process's calls (`ApiPipes`), from the loop or a request-pool thread.
    def send(self, msg: Any) -> None:
        from tp_engine.server.messages import encode

        # Encoded here, as `ApiPipes.send` does; read by "rank 0" on the loop once the sender
        # has yielded (or, from a thread, at the loop's next turn).
        self._loop.call_soon_threadsafe(self._read, encode(msg))

    def _read(self, frame: bytes) -> None:
        from tp_engine.server.messages import AddRequest, decode

        msg = decode(frame)
        if isinstance(msg, AddRequest):
            asyncio.get_running_loop().create_task(self._serve(msg.request_id))

    def async_inbox(self) -> LoopbackPipes:
        return self

    async def recv(self) -> bytes:
        return await self._inbox.get()

    async def _serve(self, request_id: str) -> None:
        from tp_engine.server.messages import Delta, EngineOutputs, EngineStats, encode

        stats = EngineStats(**_STATS)
        if not self.accept_with_first_token:
            self._inbox.put_nowait(encode(EngineOutputs([request_id], [], [], stats)))
        await asyncio.sleep(1e-3)
        for i in range(self.output_len):
            last = i == self.output_len - 1
            delta = Delta(request_id, 0, [1000 + i], "length" if last else None)
            accepted = [request_id] if i == 0 and self.accept_with_first_token else []
            self._inbox.put_nowait(encode(EngineOutputs(accepted, [], [delta], stats)))
            await asyncio.sleep(2e-4)


def request_body(args: argparse.Namespace, rng: random.Random) -> bytes:
    ids = [rng.randrange(MODEL["vocab_size"]) for _ in range(args.input_len)]
    body: dict[str, Any] = {
        "model": "m",
        "max_tokens": args.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": True,
    }
    text = " ".join(f"w{i}" for i in ids)
    if args.chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text if args.text else ids
    return json.dumps(body).encode()


async def one_request(app: Any, path: str, body: bytes) -> int:
    """One ASGI request as uvicorn hands it over; the bytes of the response's body."""
    sent = False
    done = asyncio.Event()
    received = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()  # the client never leaves
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal received
        if message["type"] == "http.response.body":
            received += len(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]  # fmt: skip
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000),
    }  # fmt: skip
    await app(scope, receive, send)
    return received


async def drive(args: argparse.Namespace, tokenizer_dir: Path) -> None:
    from tp_engine.server.api.app import build_app
    from tp_engine.server.api.engine_client import EngineClient
    from tp_engine.server.api.metrics import ServerMetrics
    from tp_engine.server.api.tokenizer_load import load_tokenizer
    from tp_engine.server.messages import Hello

    tokenizer = load_tokenizer(str(tokenizer_dir))
    hello = Hello(str(tokenizer_dir), ["m"], 4096, MODEL["vocab_size"], {}, None, 1)
    pipes = LoopbackPipes(args.output_len, args.accept_with_first_token)
    client = EngineClient(pipes, hello, ServerMetrics("m"), str(tokenizer_dir), os.getpid())
    app = build_app(client, tokenizer)
    client.start()
    rng = random.Random(args.seed)
    path = "/v1/chat/completions" if args.chat else "/v1/completions"
    bodies = [request_body(args, rng) for _ in range(args.warmup + args.requests)]
    profile = None
    for i, body in enumerate(bodies):
        if i == args.warmup and args.profile is not None:
            import cProfile

            profile = cProfile.Profile()
            profile.enable()
        if not await one_request(app, path, body):
            raise SystemExit("a request returned no body")
        if args.gap_ms:
            time.sleep(args.gap_ms / 1e3)  # the process idle, as between a served run's requests
    if profile is not None:
        profile.disable()
        profile.dump_stats(args.profile)
    await client.stop()


def stages(trace_dir: Path, skip: int) -> list[dict[str, float]]:
    events: dict[str, dict[str, float]] = {}
    for path in trace_dir.glob("api-*.jsonl"):
        for line in path.read_text().splitlines():
            e = json.loads(line)
            events.setdefault(e["id"], {}).setdefault(e["stage"], e["t"])
    ordered = sorted(events.values(), key=lambda s: s["api_route"])[skip:]
    return [
        {
            "api_parse": (s["api_add"] - s["api_route"]) * 1e3,
            "api_out": (s["api_chunk"] - s["api_delta"]) * 1e3,
        }
        for s in ordered
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--chat", action="store_true", help="/v1/chat/completions, one message")
    p.add_argument("--text", action="store_true", help="a text prompt of --input-len words")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--accept-with-first-token", action="store_true",
        help="answer `accepted` with the first token, as rank 0 did before it sent verdicts early",
    )  # fmt: skip
    p.add_argument(
        "--gap-ms", type=float, default=0.0,
        help="the process sleeps this long after each request (a served rate's idle time: its "
        "caches go cold, as in `ttft_breakdown`'s server at a few requests a second)",
    )  # fmt: skip
    p.add_argument("--label", default=None)
    p.add_argument("--profile", default=None, help="a cProfile of the event loop's thread")
    p.add_argument("--output-json", type=Path, required=True)
    args = p.parse_args(argv)
    from tp_engine.testing.tokenizers import TOKENIZERS

    work = Path(tempfile.mkdtemp(prefix="api-hops-"))
    tokenizer_dir = work / "tok"
    TOKENIZERS[MODEL["tokenizer"]](tokenizer_dir)
    trace_dir = work / "trace"
    os.environ["TP_ENGINE_REQUEST_TRACE"] = str(trace_dir)
    started = time.monotonic()
    asyncio.run(drive(args, tokenizer_dir))
    rows = stages(trace_dir, args.warmup)
    summary = {
        k: {
            "median": statistics.median(r[k] for r in rows),
            "p10": statistics.quantiles([r[k] for r in rows], n=10)[0],
            "p90": statistics.quantiles([r[k] for r in rows], n=10)[-1],
        }
        for k in ("api_parse", "api_out")
    }
    result = {
        "benchmark": "api_hops",
        "label": args.label,
        "args": {k: str(v) for k, v in vars(args).items()},
        "loadavg": os.getloadavg(),
        "duration_s": time.monotonic() - started,
        "requests": len(rows),
        "summary_ms": summary,
        "requests_ms": rows,
    }
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps(result, indent=1) + "\n")
    for k, s in summary.items():
        print(f"{k:<10} median {s['median']:.3f} ms  p10 {s['p10']:.3f}  p90 {s['p90']:.3f}")
    print(f"{len(rows)} requests, load average {os.getloadavg()[0]:.2f}; {args.output_json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
