"""Requests a hostile client or a web page would send: each is refused (or accepted within its
bounds) with a clear status, and while it is in flight `/health` and a plain completion answer
promptly. The bound is generous (a liveness property, not a benchmark): before these guards,
such requests stalled the server for 2.5 to 50 s.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.server_harness import Server, serving
from tp_engine.server.api.guards import (
    RequestGuard,
    RequestLimits,
    allowed_hosts,
    exposure_warning,
    host_name,
)

pytestmark = pytest.mark.slow

API_KEY = "sk-hostile-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON = {"Content-Type": "application/json"}
BODY_LIMIT = 256 << 10
MAX_MODEL_LEN = 256
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# Seconds within which /health and a plain 4-token completion must answer meanwhile.
PROMPT_S = 5.0


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    os.environ.setdefault("TP_ENGINE_CACHE", str(tmp_path_factory.mktemp("cache")))
    from tp_engine.demo import demo_checkpoint_dir

    log = tmp_path_factory.mktemp("log") / "server.log"
    yield from serving(
        demo_checkpoint_dir(), log,
        "--api-key", API_KEY,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--num-kv-blocks", "64",
        "--max-request-body-bytes", str(BODY_LIMIT),
        "--max-constraint-bytes", str(64 << 10),
    )  # fmt: skip


def raw(server: Server, method: str, path: str, body: Any = None, headers=None) -> tuple[int, Any]:
    """One request; `body` bytes, an iterable of bytes (sent chunked) or None."""
    conn = server.connection(timeout_s=60)
    try:
        chunked = body is not None and not isinstance(body, bytes)
        conn.request(method, path, body=body, headers=headers or {}, encode_chunked=chunked)
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(data)
    except ValueError:
        return resp.status, data


def post(server: Server, path: str, obj: Any, headers=None) -> tuple[int, Any]:
    body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return raw(server, "POST", path, body, {**JSON, **AUTH, **(headers or {})})


def alongside(server: Server, hostile: Callable[[], Any]) -> Any:
    """Run `hostile` in a thread; while it runs, /health and a plain completion must answer
    within PROMPT_S each. Returns what `hostile` returned."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(hostile)
        time.sleep(0.05)
        start = time.monotonic()
        assert server.get("/health")[0] == 200
        health_s = time.monotonic() - start
        start = time.monotonic()
        status, resp = post(server, COMPLETIONS, {"prompt": "Hi", "max_tokens": 4})
        plain_s = time.monotonic() - start
        assert status == 200 and resp["usage"]["completion_tokens"] == 4, resp
        assert health_s < PROMPT_S and plain_s < PROMPT_S, (health_s, plain_s)
        return future.result(timeout=120)


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def assert_refused(result: tuple[int, Any], status: int, param: str | None, words: str) -> None:
    code, resp = result
    assert code == status, resp
    assert resp["error"]["param"] == param, resp
    assert words in resp["error"]["message"], resp


# -- bounded work ------------------------------------------------------------------------------


def test_a_deeply_nested_schema_is_refused_before_anything_parses_it(server):
    # 900 levels as a JSON string (22 KB): once 75 s of xgrammar while everything waited.
    text = json.dumps(nested_schema(900))
    result = alongside(
        server, lambda: post(server, COMPLETIONS, {"prompt": "Hi", "guided_json": text})
    )
    assert_refused(result, 400, "guided_json", "nests deeper than this server's limit of 64")
    body = {"prompt": "Hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": nested_schema(100)}}}  # fmt: skip
    assert_refused(post(server, COMPLETIONS, body), 400, "response_format.json_schema.schema",
                   "nests deeper")  # fmt: skip
    big = {"prompt": "Hi", "structured_outputs": {"regex": "a" * (300 << 10)}}
    code, resp = post(server, COMPLETIONS, big)
    assert code == 413, resp  # over the body limit before the constraint limit
    limit_regex = {"prompt": "Hi", "structured_outputs": {"regex": "(ab|cd)" * 12000}}
    assert_refused(post(server, COMPLETIONS, limit_regex), 400, "structured_outputs.regex",
                   "--max-constraint-bytes")  # fmt: skip
    # Within the limits it is served, constrained.
    ok = {"prompt": "Hi", "max_tokens": 8, "guided_json": json.dumps(nested_schema(3))}
    code, resp = post(server, COMPLETIONS, ok)
    assert code == 200, resp


def test_tool_parameters_nested_too_deep_name_the_tool(server):
    body = {"messages": [{"role": "user", "content": "Hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"x": nested_schema(80)}}}}]}  # fmt: skip
    assert_refused(post(server, CHAT, body), 400, "tools.0.function.parameters", "nests deeper")


def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    big = b'{"prompt": "' + b"a" * (2 * BODY_LIMIT) + b'"}'
    code, resp = alongside(server, lambda: post(server, COMPLETIONS, big))
    assert code == 413 and "--max-request-body-bytes" in resp["error"]["message"], resp

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(2 * BODY_LIMIT // 4096):
            yield b"a" * 4096
        yield b'"}'

    code, resp = alongside(
        server, lambda: raw(server, "POST", COMPLETIONS, chunked(), {**JSON, **AUTH})
    )
    assert code == 413, resp


def test_a_prompt_far_beyond_max_model_len_is_refused_untokenized(server):
    text = "word " * 40000  # 200 KB, under the body limit; the demo holds 256 tokens
    result = alongside(server, lambda: post(server, COMPLETIONS, {"prompt": text}))
    assert_refused(result, 400, "prompt", "needs more than max_model_len (256) tokens")
    code, resp = post(server, "/tokenize", {"prompt": text})
    assert_refused((code, resp), 400, "prompt", "max_model_len")


def test_tokenize_is_bounded_and_off_the_loop(server):
    text = "Hello world. " * 200  # tokenized in the request pool
    code, resp = alongside(server, lambda: post(server, "/tokenize", {"prompt": text}))
    assert code == 200 and resp["count"] == len(resp["tokens"]) > 200, resp


def test_malformed_tool_call_arguments_are_a_400_naming_the_field(server):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 100000}}
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    result = alongside(server, lambda: post(server, CHAT, {"messages": messages}))
    assert_refused(result, 400, "messages.1.tool_calls.0.function.arguments", "nests too deeply")


# -- who may send what ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_tokenizer_routes_need_the_key(server, path):
    body = {"prompt": "Hi"} if path == "/tokenize" else {"tokens": [1, 2]}
    code, resp = raw(server, "POST", path, json.dumps(body).encode(), JSON)
    assert code == 401 and resp["error"]["code"] == "invalid_api_key", resp
    assert post(server, path, body)[0] == 200


def test_reads_need_the_key_and_health_version_metrics_stay_open(server):
    for path in ("/tokenizer_info", "/v1/models"):
        assert raw(server, "GET", path)[0] == 401, path
        assert raw(server, "GET", path, headers=AUTH)[0] == 200, path
    for path in ("/health", "/version", "/metrics"):
        assert raw(server, "GET", path)[0] == 200, path


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_a_body_that_is_not_json_is_415(server, content_type):
    # What a web page can send cross-origin without a preflight.
    headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    code, resp = alongside(server, lambda: raw(server, "POST", COMPLETIONS, body, headers))
    assert code == 415 and "application/json" in resp["error"]["message"], resp
    charset = {**AUTH, "Content-Type": "application/json; charset=utf-8"}
    assert raw(server, "POST", COMPLETIONS, body, charset)[0] == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example"])
def test_a_host_the_server_does_not_answer_to_is_421(server, host):
    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    code, resp = raw(server, "POST", COMPLETIONS, body, {**JSON, **AUTH, "Host": host})
    assert code == 421 and "--allowed-hosts" in resp["error"]["message"], resp
    assert raw(server, "GET", "/health", headers={"Host": host})[0] == 421


@pytest.mark.parametrize(
    "host", ["localhost", "localhost:{port}", "127.0.0.1:{port}", "[::1]:{port}"]
)
def test_loopback_names_are_answered(server, host):
    headers = {"Host": host.format(port=server.port)}
    assert raw(server, "GET", "/health", headers=headers)[0] == 200


def test_no_exposure_warning_on_loopback_with_a_key(server):
    assert "WITHOUT an API key" not in server.log()


# -- a server open to the network, and a constraint that compiles too slowly ---------------------


@pytest.fixture(scope="module")
def open_server(tmp_path_factory) -> Iterator[Server]:
    """0.0.0.0 without a key, a tiny model with Qwen3's 151,669-token tokenizer (its first
    grammar compilation reads the whole vocabulary: about a second), and a time limit a third
    of that."""
    from tp_engine.testing import QWEN3_VOCAB_ROWS, build_random_qwen3

    model = build_random_qwen3(
        tmp_path_factory.mktemp("qwen3-tok"), hidden_size=32, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=16, intermediate_size=64, vocab_size=QWEN3_VOCAB_ROWS,
        max_position_embeddings=256, tokenizer="qwen3",
    )  # fmt: skip
    env = dict(os.environ)
    env.pop("TP_ENGINE_FAULT", None)
    log = tmp_path_factory.mktemp("log") / "open-server.log"
    cmd = [sys.executable, "launch/serve.py", "--model", str(model), "--port", "0",
           "--host", "0.0.0.0", "--max-model-len", "256", "--num-kv-blocks", "64",
           "--structured-outputs-timeout", "0.3"]  # fmt: skip
    srv = Server(cmd, env, log).wait_ready()
    yield srv
    srv.stop()


def test_binding_beyond_loopback_without_a_key_warns_loudly(open_server):
    log = open_server.log()
    assert "listens on '0.0.0.0', beyond this machine's loopback, WITHOUT an API key" in log
    # A wildcard bind without --allowed-hosts answers to any name (clients use the machine's).
    assert raw(open_server, "GET", "/health", headers={"Host": "gpu-box.lan:8000"})[0] == 200


def test_a_grammar_that_does_not_compile_in_time_is_400_and_others_run_on(open_server):
    srv = open_server
    # The API process parses constraints with xgrammar: an invalid one imports it there, so
    # the next check is fast and the time goes to rank 0's compilation.
    bad = {"prompt": "Hi", "guided_json": "{not json"}
    code, resp = raw(srv, "POST", COMPLETIONS, json.dumps(bad).encode(), JSON)
    assert code == 400 and resp["error"]["param"] == "guided_json", resp
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = json.dumps({"prompt": "Hi", "max_tokens": 16, "guided_json": schema}).encode()

    def plain_and_health() -> None:
        start = time.monotonic()
        assert srv.get("/health")[0] == 200
        plain = json.dumps({"prompt": "Hi", "max_tokens": 4}).encode()
        code, resp = raw(srv, "POST", COMPLETIONS, plain, JSON)
        assert code == 200 and resp["usage"]["completion_tokens"] == 4, resp
        assert time.monotonic() - start < 2 * PROMPT_S

    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(raw, srv, "POST", COMPLETIONS, body, JSON)
        plain_and_health()
        code, resp = slow.result(timeout=60)
    assert code == 400, resp
    assert "did not compile within 0.3 s" in resp["error"]["message"], resp
    # The compilation finished in the background and is cached: the same constraint is served.
    deadline = time.monotonic() + 30
    while True:
        code, resp = raw(srv, "POST", COMPLETIONS, body, JSON)
        if code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert code == 200, resp


# -- units --------------------------------------------------------------------------------------


def test_allowed_hosts_and_the_warning():
    assert allowed_hosts("127.0.0.1", None) == ("localhost", "127.0.0.1", "::1")
    assert allowed_hosts("myhost", ["api.example"])[-2:] == ("api.example", "myhost")
    assert allowed_hosts("0.0.0.0", None) == () and allowed_hosts("::", None) == ()
    assert "box.lan" in allowed_hosts("0.0.0.0", ["box.lan"])
    assert allowed_hosts("127.0.0.1", ["*"]) == ()
    assert exposure_warning("127.0.0.1", None) is None
    assert exposure_warning("::1", None) is None and exposure_warning("localhost", None) is None
    assert exposure_warning("0.0.0.0", "k") is None
    assert "WITHOUT an API key" in exposure_warning("0.0.0.0", None)
    assert "WITHOUT an API key" in exposure_warning("10.0.0.5", None)
    assert host_name(b"[::1]:8000") == "::1" and host_name(b"LocalHost:80") == "localhost"
    assert host_name(b"example.com") == "example.com"


def test_limits_survive_the_trip_to_the_api_process():
    limits = RequestLimits(max_body_bytes=5, allowed_hosts=("a", "b"), constraint_timeout_s=0.5)
    assert RequestLimits.from_wire(json.loads(json.dumps(limits.to_wire()))) == limits


def test_a_constraint_check_past_its_time_limit_is_a_400_and_frees_the_loop():
    import asyncio

    from tp_engine.server.api.http_errors import APIError
    from tp_engine.server.api.request_work import RequestWork

    work = RequestWork(RequestLimits(constraint_timeout_s=0.2))

    async def main() -> tuple[float, float]:
        start = time.monotonic()
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        with pytest.raises(APIError, match=r"took longer than 0\.2 s") as err:
            await work.constraint(time.sleep, 2.0)
        task.cancel()
        assert err.value.status == 400
        return time.monotonic() - start, ticks

    elapsed, ticks = asyncio.run(main())
    work.shutdown()
    assert elapsed < 1.0 and ticks >= 5  # answered at the limit; the loop kept running


def test_the_length_check_does_not_tokenize(tmp_path: Path):
    from tp_engine.server.api.http_errors import APIError
    from tp_engine.server.api.prompts import PromptBuilder
    from tp_engine.server.api.protocol import CompletionRequest
    from tp_engine.server.messages import Hello

    class Counting:
        calls = 0

        def get_vocab(self) -> dict[str, int]:
            return {"a": 0, "abcd": 1}

        def __call__(self, text: str, **kwargs: Any) -> dict[str, list[int]]:
            Counting.calls += 1
            return {"input_ids": [0] * len(text)}

    builder = PromptBuilder(Counting(), Hello("/m", ["m"], 10, 2, {}, None, 1))
    assert builder.max_token_chars == 4
    fits = CompletionRequest(prompt="a" * 160)  # 10 tokens x 4 chars x slack 4
    builder.completion_prompts(fits)
    assert Counting.calls == 1
    with pytest.raises(APIError, match="161 characters"):
        builder.completion_prompts(CompletionRequest(prompt="a" * 161))
    assert Counting.calls == 1


def test_protect_metrics_and_docs_puts_them_behind_the_key():
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    async def ok(request):
        return PlainTextResponse("ok")

    paths = ["/metrics", "/docs", "/redoc", "/openapi.json", "/health", "/version"]
    app = Starlette(routes=[Route(p, ok) for p in paths])
    for protect in (False, True):
        limits = RequestLimits(protect_metrics_and_docs=protect, allowed_hosts=())
        client = TestClient(RequestGuard(app, limits, API_KEY))
        for path in paths:
            closed = protect and path not in ("/health", "/version")
            assert client.get(path).status_code == (401 if closed else 200), (protect, path)
            assert client.get(path, headers=AUTH).status_code == 200


def test_protect_metrics_and_docs_needs_a_key():
    from tp_engine.server.args import build_parser, server_args

    args = build_parser().parse_args(["--protect-metrics-and-docs", "--api-key", ""])
    args.api_key = None
    with pytest.raises(ValueError, match="needs --api-key"):
        server_args(args)
    args.api_key = "k"
    assert server_args(args).limits.protect_metrics_and_docs


def _bare_guarded_app(paths, methods=("GET",)):
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    async def ok(request):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route(p, ok, methods=list(methods)) for p in paths])
    return TestClient(RequestGuard(app, RequestLimits(allowed_hosts=()), API_KEY))


def test_the_key_covers_every_route_outside_the_open_list():
    """Inverted guard: a route nobody listed (the RL and admin routes, anything added later) needs
    the key; only the open list answers without it."""
    keyed = ["/v1", "/v1/models", "/tokenize", "/tokenizer_info", "/health_generate", "/sleep",
             "/update_weights_from_disk", "/pause", "/some/future/route"]  # fmt: skip
    open_ = ["/health", "/version", "/metrics", "/docs", "/openapi.json", "/get_model_info",
             "/get_server_info", "/get_load"]  # fmt: skip
    client = _bare_guarded_app(keyed + open_)
    for path in keyed:
        assert client.get(path).status_code == 401, path
        assert client.get(path, headers=AUTH).status_code == 200, path
    for path in open_:
        assert client.get(path).status_code == 200, path


def test_a_post_without_a_body_passes_the_media_type_check():
    """RL clients send `POST /sleep?level=1` with no body and no Content-Type: nothing to check.
    A body still has to be JSON, chunked or not."""
    client = _bare_guarded_app(["/sleep"], methods=("POST",))
    assert client.post("/sleep?level=1", headers=AUTH).status_code == 200
    assert client.post("/sleep", headers={**AUTH, "Content-Length": "0"}).status_code == 200
    text = {**AUTH, "Content-Type": "text/plain"}
    assert client.post("/sleep", content=b"level=1", headers=text).status_code == 415
    chunked = client.post("/sleep", content=iter([b"level=1"]), headers=AUTH)
    assert chunked.status_code == 415
    assert client.post("/sleep", json={"level": 1}, headers=AUTH).status_code == 200


def test_admin_routes_are_absent_without_their_flags(server):
    """Weight updates, pause and sleep exist only with --enable-weight-updates /
    --enable-sleep-mode: this server has neither (404 even with the key)."""
    for method, path in (("POST", "/pause"), ("POST", "/update_weights_from_disk"),
                         ("POST", "/sleep"), ("GET", "/is_sleeping")):  # fmt: skip
        assert raw(server, method, path, headers=AUTH)[0] == 404, path
