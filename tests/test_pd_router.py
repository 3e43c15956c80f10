"""Prefill/decode disaggregation end to end: the real `sglang-router --pd-disaggregation` in
front of a prefill server and a decode server (`launch/serve.py --disaggregation-mode`), the KV
pages moved between their ranks by Mooncake's transfer engine over TCP, at TP 1 and TP 2. The
decode runs as another machine would: in its own namespaces, /dev/shm and /tmp.

Greedy outputs through the router equal the decode server answering the same requests alone
(a request without bootstrap fields is computed whole there) and transformers; the decode
computes none of a paired request's prompt (`tp_engine:prompt_tokens_computed` does not move,
its prompt counts as external prefix-cache hits and as cached tokens). The faults each end the
one request with an error naming what went wrong, its blocks freed, the servers serving on.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.multinode_harness import start_node1
from tests.server_harness import REPO_ROOT, Server, parse_sse, wait_until
from tp_engine.server.rank0.replicas import free_port

pytestmark = pytest.mark.slow

PROMPTS = ["Hello, my name is", "The quick brown fox jumps over", "Once upon a time, in a land"]
MAX_TOKENS = 6
MODEL = "tp-engine-demo"  # the router asks for one; the servers answer to the checkpoint's path
# Short, so that the fault cases end within the test; long enough for a loaded machine's pairs.
TIMEOUT_S = 8


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    from tp_engine.demo import demo_checkpoint_dir

    return demo_checkpoint_dir()


def doc_commands() -> list[list[str]]:
    """docs/disaggregation.md's one-machine commands: prefill, decode, router."""
    text = (REPO_ROOT / "docs" / "disaggregation.md").read_text()
    section = text.split("## Try it on one machine", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    commands = [shlex.split(b.replace("\\\n", " ")) for b in blocks[:3]]
    assert [c[:2] for c in commands] == [
        ["python", "launch/serve.py"], ["python", "launch/serve.py"], ["python", "-m"]
    ]  # fmt: skip
    return commands


def swap(cmd: list[str], values: dict[str, str]) -> list[str]:
    """`cmd` with `sys.executable` for python and each value in `values` replaced."""
    return [sys.executable if a == "python" else values.get(a, a) for a in cmd]


class Router:
    def __init__(self, cmd: list[str], port: int, log: Path) -> None:
        self.port = port
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        # Its metrics on a port of their own; two retries, not five (the killed prefill's test
        # waits for each retry's decode half to time out).
        extra = ["--prometheus-host", "127.0.0.1", "--prometheus-port",
                 str(free_port("127.0.0.1")), "--retry-max-retries", "2"]  # fmt: skip
        self.proc = subprocess.Popen(
            [*cmd, *extra, "--log-level", "warn"], cwd=REPO_ROOT, stdout=self._log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.log_path = log

    def post(self, path: str, body: dict[str, Any], timeout_s: float = 120.0) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        if body.get("stream"):
            return resp.status, parse_sse(data)
        try:
            return resp.status, json.loads(data)
        except ValueError:
            return resp.status, data.decode(errors="replace")

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        last: Any = None
        probe = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                last = self.post("/generate", probe, 30)
                if last[0] == 200:
                    return
            except OSError as exc:
                last = exc
            time.sleep(0.5)
        raise AssertionError(f"router not ready: {last}\n{self.log_path.read_text()}")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._log.close()


def pd_env() -> tuple[dict[str, str], str]:
    tmpdir = tempfile.mkdtemp(prefix="pd-")
    env = dict(os.environ, TMPDIR=tmpdir)
    env["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] = str(TIMEOUT_S)
    env["SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"] = str(TIMEOUT_S)
    env["SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL"] = "1"
    for name in ("TP_ENGINE_FAULT", "RANK", "WORLD_SIZE"):
        env.pop(name, None)
    return env, tmpdir


@contextlib.contextmanager
def pd_servers(
    checkpoint: Path,
    tp: int,
    logs: Path,
    prefill_flags: tuple[str, ...] = (),
    decode_flags: tuple[str, ...] = (),
) -> Iterator[tuple[Server, Server, Router, int]]:
    """The page's prefill, decode and router on `checkpoint` at TP `tp` (ports of their own),
    each server with its `*_flags` besides."""
    env, tmpdir = pd_env()
    prefill_cmd, decode_cmd, router_cmd = doc_commands()
    bootstrap_port = free_port("127.0.0.1")
    ours = ["--model", str(checkpoint), "--served-model-name", MODEL, "--tensor-parallel-size",
            str(tp), "--num-kv-blocks", "96", "--disable-uvicorn-access-log"]  # fmt: skip
    ports = {"30000": "0", "30001": "0", "8998": str(bootstrap_port)}
    prefill = Server([*swap(prefill_cmd, ports), *ours, *prefill_flags], env, logs / "prefill.log")
    # The decode is another "machine": its own mount, IPC and pid namespaces, /dev/shm and
    # /tmp (`multinode_harness`); only loopback TCP joins the two servers, as a network would.
    decode_env = {k: v for k, v in env.items() if k != "TMPDIR"}
    decode = start_node1([*swap(decode_cmd, ports), *ours, *decode_flags], checkpoint,
                         logs / "decode.log", decode_env)  # fmt: skip
    router = None
    try:
        prefill.wait_ready()
        decode.wait_ready()
        router_port = free_port("127.0.0.1")
        urls = {
            "http://127.0.0.1:30000": f"http://127.0.0.1:{prefill.port}",
            "http://127.0.0.1:30001": f"http://127.0.0.1:{decode.port}",
            "8998": str(bootstrap_port), "8000": str(router_port),
        }  # fmt: skip
        router = Router(swap(router_cmd, urls), router_port, logs / "router.log")
        router.wait_ready()
        yield prefill, decode, router, bootstrap_port
    finally:
        if router is not None:
            router.stop()
        for server in (prefill, decode):
            server.stop()
        shutil.rmtree(tmpdir, ignore_errors=True)
    for server in (prefill, decode):
        assert "Traceback" not in server.log(), server.log_tail()


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def pd(request, checkpoint, tmp_path_factory):
    with pd_servers(checkpoint, request.param, tmp_path_factory.mktemp("logs")) as servers:
        yield (*servers, request.param)


def hf_greedy(checkpoint: Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
            do_sample=False,
        )  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()


def completion(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}  # fmt: skip


def test_router_outputs_equal_the_decode_alone_and_transformers(pd, checkpoint):
    prefill, decode, router, _, _ = pd
    computed_before = decode.metric("tp_engine:prompt_tokens_computed_total")
    external_before = decode.metric("vllm:external_prefix_cache_hits_total")
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # at once: the pairs overlap
        routed = list(pool.map(lambda p: router.post("/v1/completions", completion(p)), PROMPTS))
    prompt_tokens = 0
    for prompt, (status, body) in zip(PROMPTS, routed, strict=True):
        assert status == 200, body
        choice = body["choices"][0]
        alone_status, alone = decode.post("/v1/completions", completion(prompt))
        assert alone_status == 200, alone
        assert choice["token_ids"] == alone["choices"][0]["token_ids"]
        assert choice["text"] == alone["choices"][0]["text"]
        assert choice["token_ids"] == hf_greedy(checkpoint, choice["prompt_token_ids"], MAX_TOKENS)
        # Every prompt token came from the prefill: the decode computed none of them.
        usage = body["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]
        prompt_tokens += usage["prompt_tokens"]
    assert decode.metric("vllm:external_prefix_cache_hits_total") - external_before == prompt_tokens
    # Only the requests sent to the decode alone computed prompts there (its prefix cache is
    # off: each computed its whole prompt), the routed ones none.
    computed = decode.metric("tp_engine:prompt_tokens_computed_total") - computed_before
    assert computed == prompt_tokens
    assert prefill.metric("tp_engine:prompt_tokens_computed_total") >= prompt_tokens


def test_the_prefills_prefix_cache_computes_only_new_pages_and_sends_all(pd):
    prefill, decode, router, _, _ = pd
    shared = "a shared system prompt for every request of this test, " * 6
    first = router.post("/v1/completions", completion(shared + "then one"))
    assert first[0] == 200, first[1]
    before = prefill.metric("tp_engine:prompt_tokens_computed_total")
    status, body = router.post("/v1/completions", completion(shared + "then two"))
    assert status == 200, body
    computed = prefill.metric("tp_engine:prompt_tokens_computed_total") - before
    prompt_tokens = body["usage"]["prompt_tokens"]
    assert computed < prompt_tokens - 16  # the shared full blocks were hits on the prefill
    alone = decode.post("/v1/completions", completion(shared + "then two"))[1]
    assert body["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]


def test_logprobs_and_min_tokens_through_the_router(pd):
    """The first token's logprobs are the prefill's; `min_tokens` holds on both halves."""
    _, decode, router, _, _ = pd
    body = completion(PROMPTS[2], logprobs=2, min_tokens=3)
    status, routed = router.post("/v1/completions", body)
    assert status == 200, routed
    alone = decode.post("/v1/completions", body)[1]
    got, want = routed["choices"][0], alone["choices"][0]
    assert got["token_ids"] == want["token_ids"]
    assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
    for a, b in zip(
        got["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"], strict=True
    ):
        assert a == pytest.approx(b, abs=1e-4)
    got_top, want_top = got["logprobs"]["top_logprobs"], want["logprobs"]["top_logprobs"]
    assert [sorted(t) for t in got_top] == [sorted(t) for t in want_top]
    assert got_top[0] == pytest.approx(want_top[0], abs=1e-4)  # the prefill's entry


def test_a_full_decode_pool_makes_requests_wait_not_fail(pd):
    _, decode, router, _, _ = pd
    # Eight prompts of ~300 tokens need more than the decode's 96 blocks of 16 at once.
    prompts = [f"request {i}: " + "tell me more about it, " * 50 for i in range(8)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        routed = list(pool.map(lambda p: router.post("/v1/completions", completion(p)), prompts))
    assert sum(r[1]["usage"]["prompt_tokens"] for r in routed) > 96 * 16
    for prompt, (status, body) in zip(prompts, routed, strict=True):
        assert status == 200, body
        alone = decode.post("/v1/completions", completion(prompt))[1]
        assert body["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]


def test_chat_streaming_and_generate_through_the_router(pd):
    _, decode, router, _, _ = pd
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    status, body = router.post("/v1/chat/completions", chat)
    assert status == 200, body
    alone_status, alone = decode.post("/v1/chat/completions", chat)
    assert alone_status == 200, alone
    text = body["choices"][0]["message"]["content"]
    assert text == alone["choices"][0]["message"]["content"]
    status, events = router.post("/v1/chat/completions", {**chat, "stream": True})
    assert status == 200, events
    streamed = "".join(
        e["choices"][0]["delta"].get("content") or ""
        for e in events
        if isinstance(e, dict) and e.get("choices")
    )
    assert streamed == text
    generate = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True}}  # fmt: skip
    status, routed = router.post("/generate", generate)
    assert status == 200, routed
    alone_status, alone = decode.post("/generate", generate)
    assert alone_status == 200, alone
    assert routed["output_ids"] == alone["output_ids"]
    assert routed["meta_info"]["completion_tokens"] == MAX_TOKENS


def test_each_server_reports_its_role_to_the_router(pd):
    prefill, decode, _, _, tp = pd
    for server, mode in ((prefill, "prefill"), (decode, "decode")):
        status, body = server.get("/get_server_info")
        assert status == 200
        info = json.loads(body)
        assert info["disaggregation_mode"] == mode and info["tp_size"] == tp


def test_sglangs_fake_bootstrap_host_needs_no_prefill(pd):
    _, decode, _, _, _ = pd
    before = decode.metric("tp_engine:prompt_tokens_computed_total")
    body = completion(PROMPTS[1], bootstrap_host="2.2.2.2", bootstrap_room=7)
    status, resp = decode.post("/v1/completions", body)
    assert status == 200, resp
    assert len(resp["choices"][0]["token_ids"]) == MAX_TOKENS
    assert decode.metric("tp_engine:prompt_tokens_computed_total") == before


class _StubBootstrap:
    """A bootstrap server that answers as a prefill of another page size would."""

    def __init__(self, facts: dict[str, Any]) -> None:
        data = json.dumps(facts).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()


def test_faults_end_one_request_each_and_free_its_blocks(pd):
    prefill, decode, _, bootstrap_port, tp = pd
    stub = _StubBootstrap({"page_size": 32, "attn_tp_size": tp, "kv_requests": "tcp://127.0.0.1:1"})
    other_tp = _StubBootstrap({"page_size": 16, "attn_tp_size": tp + 1})
    cases = {
        # The decode's pages never come: its prefill never gets the request.
        "never": (decode, dict(bootstrap_host="127.0.0.1", bootstrap_port=bootstrap_port, bootstrap_room=101)),
        # A prefill whose decode never asks for the pages.
        "unasked": (prefill, dict(bootstrap_host="127.0.0.1", bootstrap_port=bootstrap_port, bootstrap_room=102)),
        # Nothing listens at the bootstrap address.
        "unreachable": (decode, dict(bootstrap_host="127.0.0.1", bootstrap_port=free_port("127.0.0.1"), bootstrap_room=103)),
        # A prefill of another page size.
        "mismatch": (decode, dict(bootstrap_host="127.0.0.1", bootstrap_port=stub.port, bootstrap_room=104)),
        # A prefill of another tensor-parallel size.
        "tp": (decode, dict(bootstrap_host="127.0.0.1", bootstrap_port=other_tp.port, bootstrap_room=105)),
    }  # fmt: skip
    start = time.monotonic()
    with ThreadPoolExecutor(len(cases)) as pool:
        futures = {
            name: pool.submit(server.post, "/v1/completions", completion(PROMPTS[0], **fields))
            for name, (server, fields) in cases.items()
        }
        results = {name: f.result() for name, f in futures.items()}
    elapsed = time.monotonic() - start
    stub.http.shutdown()
    other_tp.http.shutdown()
    for name, (status, body) in results.items():
        assert status == 500, (name, body)
    message = {name: body["error"]["message"] for name, (_, body) in results.items()}
    assert f"did not arrive within {TIMEOUT_S} s" in message["never"]
    assert "no decode asked for its pages" in message["unasked"]
    assert "cannot be reached" in message["unreachable"]
    assert "has page_size 32, this decode 16" in message["mismatch"]
    assert f"runs tensor parallel {tp + 1}, this decode {tp} (both must be equal)" in message["tp"]
    assert elapsed < 4 * TIMEOUT_S
    # Nothing left behind, and both still serve.
    for server in (prefill, decode):
        wait_until(lambda s=server: s.metric("vllm:kv_cache_usage_perc") == 0, 10, "blocks freed")
        assert server.metric("vllm:num_requests_waiting") == 0
        status, body = server.post("/v1/completions", completion(PROMPTS[2]))
        assert status == 200, body


def test_a_client_that_leaves_frees_the_decodes_pages_at_once(pd):
    _, decode, _, bootstrap_port, _ = pd
    body = completion(PROMPTS[0], bootstrap_host="127.0.0.1", bootstrap_port=bootstrap_port,
                      bootstrap_room=201)  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", decode.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    wait_until(lambda: decode.metric("vllm:kv_cache_usage_perc") > 0, 5, "the pages taken")
    # A room is one request's: another request of the same room is refused.
    status, again = decode.post("/v1/completions", body)
    assert status == 400 and "bootstrap_room 201 is in use" in again["error"]["message"], again
    left = time.monotonic()
    conn.close()
    wait_until(lambda: decode.metric("vllm:kv_cache_usage_perc") == 0, 5, "the pages freed")
    assert time.monotonic() - left < TIMEOUT_S  # the abort, not the waiting timeout
    assert decode.metric("vllm:num_requests_waiting") == 0


def test_a_client_that_leaves_a_prefill_gives_its_kept_pages_back_at_once(pd):
    """Computed and waiting for a decode that has not asked: its kept blocks go back when its
    client leaves, not after the bootstrap timeout."""
    prefill, _, _, bootstrap_port, _ = pd
    body = completion(PROMPTS[1], bootstrap_host="127.0.0.1", bootstrap_port=bootstrap_port,
                      bootstrap_room=202)  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", prefill.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    wait_until(lambda: prefill.metric("vllm:kv_cache_usage_perc") > 0, 5, "the pages kept")
    wait_until(lambda: prefill.metric("vllm:num_requests_running") == 0, 5, "its token computed")
    left = time.monotonic()
    conn.close()
    wait_until(lambda: prefill.metric("vllm:kv_cache_usage_perc") == 0, 5, "the pages freed")
    assert time.monotonic() - left < TIMEOUT_S  # the abort, not the bootstrap timeout


def test_a_write_to_a_decode_that_is_gone_fails_the_prefills_request(pd):
    """A decode that asked for the pages and died before they were written (its ranks'
    transfer engines closed): every prefill rank's write fails fast, the prefill's client gets
    500 naming the peer, the decode's status says why, and the kept blocks go back."""
    import zmq

    from shm_ipc import wire
    from shm_ipc.pd_wire import KVRequest, KVStatus, PeerRank, Region, decode_pd

    prefill, _, _, bootstrap_port, tp = pd
    facts = json.loads(urllib.request.urlopen(
        f"http://127.0.0.1:{bootstrap_port}/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
        "&target_tp_rank=-1&target_pp_rank=-1", timeout=10).read())  # fmt: skip
    gone = f"127.0.0.1:{free_port('127.0.0.1')}"  # nothing listens there any more
    region = Region(0, facts["num_layers"], 1 << 20, 1 << 19, facts["block_bytes"], 64)
    ctx = zmq.Context.instance()
    status_sock = ctx.socket(zmq.PULL)
    status_port = status_sock.bind_to_random_port("tcp://127.0.0.1")
    ask_sock = ctx.socket(zmq.PUSH)
    ask_sock.connect(facts["kv_requests"])
    plain = prefill.post("/v1/completions", completion(PROMPTS[0]))[1]
    num_tokens = len(plain["choices"][0]["prompt_token_ids"])
    try:
        body = completion(PROMPTS[0], bootstrap_host="127.0.0.1", bootstrap_port=bootstrap_port,
                          bootstrap_room=203)  # fmt: skip
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(prefill.post, "/v1/completions", body)
            wait_until(lambda: prefill.metric("vllm:kv_cache_usage_perc") > 0, 5, "pages kept")
            blocks = list(range(-(-num_tokens // 16)))
            ask = KVRequest(203, num_tokens, blocks, [PeerRank(gone, region)] * tp,
                            f"tcp://127.0.0.1:{status_port}")  # fmt: skip
            ask_sock.send(wire.encode(ask))
            status, resp = answer.result(timeout=30)
        assert status == 500, resp
        assert f"KV transfer to {gone} failed" in resp["error"]["message"], resp
        assert status_sock.poll(10_000), "no KVStatus came"
        kv_status = decode_pd(status_sock.recv(), "the prefill")
        assert isinstance(kv_status, KVStatus) and kv_status.room == 203
        assert kv_status.error is not None and gone in kv_status.error
        wait_until(lambda: prefill.metric("vllm:kv_cache_usage_perc") == 0, 5, "the pages freed")
    finally:
        ask_sock.close(linger=0)
        status_sock.close(linger=0)


def test_zz_a_killed_prefill_fails_its_requests_and_leaves_no_orphan(pd):
    """Last of its servers' tests: the prefill is gone afterwards."""
    prefill, decode, router, bootstrap_port, _ = pd
    body = completion(PROMPTS[0], bootstrap_host="127.0.0.1", bootstrap_port=bootstrap_port,
                      bootstrap_room=301)  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        waiting = pool.submit(decode.post, "/v1/completions", body)
        wait_until(lambda: decode.metric("vllm:kv_cache_usage_perc") > 0, 5, "the pages taken")
        for pid in prefill.descendants() | {prefill.proc.pid}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        prefill.proc.wait()
        killed = time.monotonic()
        # The router's retries with new rooms reach the decode too; each of them ends.
        routed = pool.submit(router.post, "/v1/completions", completion(PROMPTS[1]))
        status, resp = waiting.result()
        # Its heartbeats (every second here) found the prefill gone, well before the timeout.
        assert status == 500 and "is gone" in resp["error"]["message"], resp
        assert time.monotonic() - killed < TIMEOUT_S
        assert routed.result()[0] >= 500
    wait_until(
        lambda: decode.metric("vllm:num_requests_waiting") == 0
        and decode.metric("vllm:kv_cache_usage_perc") == 0,
        2 * TIMEOUT_S, "no orphan on the decode",
    )  # fmt: skip
    status, body = decode.post("/v1/completions", completion(PROMPTS[2]))
    assert status == 200, body


def test_moe_at_tp2_through_the_router_equals_the_decode_alone(tmp_path_factory):
    """Qwen3-MoE, its experts sliced over the two ranks of each server."""
    from tests.moe_cases import MOE_CHECKPOINTS
    from tp_engine.testing import build_random_qwen3_moe

    shape = dict(MOE_CHECKPOINTS["moe_e8k3_mixed"], max_position_embeddings=256)
    moe = build_random_qwen3_moe(tmp_path_factory.mktemp("moe"), **shape)
    with pd_servers(moe, 2, tmp_path_factory.mktemp("moe-logs")) as (_, decode, router, _):
        for prompt in PROMPTS[:2]:
            status, body = router.post("/v1/completions", completion(prompt))
            assert status == 200, body
            alone = decode.post("/v1/completions", completion(prompt))[1]
            assert body["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
            usage = body["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]


def test_host_staging_pools_on_both_servers_at_tp2(checkpoint, tmp_path_factory):
    """Every rank of both servers moves its pages through a host staging pool (the path of a
    device cache that cannot be registered, forced with `--disaggregation-host-staging on`):
    the prefill's pool holds two pages, so each write is several gathers; the decode's holds
    eight, fewer than the requests sent at once need, so they wait for slots. The outputs equal
    the decode's alone and transformers', the decode computes no prompt, and a prompt longer
    than the decode's pool fails at once with a message naming the flag."""

    def staging(tokens: int) -> tuple[str, ...]:
        return ("--disaggregation-host-staging", "on",
                "--disaggregation-host-staging-tokens", str(tokens))  # fmt: skip

    logs = tmp_path_factory.mktemp("staging-logs")
    with pd_servers(checkpoint, 2, logs, staging(32), staging(128)) as servers:
        prefill, decode, router, bootstrap_port = servers
        assert "host staging pool of 2 blocks" in prefill.log()
        assert "host staging pool of 8 blocks" in decode.log()
        prompts = [f"request {i}: " + "tell me more, " * 10 for i in range(4)]
        computed_before = decode.metric("tp_engine:prompt_tokens_computed_total")
        with ThreadPoolExecutor(len(prompts)) as pool:
            routed = list(
                pool.map(lambda p: router.post("/v1/completions", completion(p)), prompts)
            )
        assert all(status == 200 for status, _ in routed), routed
        lengths = [body["usage"]["prompt_tokens"] for _, body in routed]
        assert max(lengths) <= 128 < sum(lengths), lengths  # each fits; not all at once
        assert decode.metric("tp_engine:prompt_tokens_computed_total") == computed_before
        for prompt, (_, body) in zip(prompts, routed, strict=True):
            choice = body["choices"][0]
            alone = decode.post("/v1/completions", completion(prompt))[1]
            assert choice["token_ids"] == alone["choices"][0]["token_ids"]
            assert choice["token_ids"] == hf_greedy(checkpoint, choice["prompt_token_ids"],
                                                    MAX_TOKENS)  # fmt: skip
        long = completion("tell me more about it, " * 40, bootstrap_host="127.0.0.1",
                          bootstrap_port=bootstrap_port, bootstrap_room=401)  # fmt: skip
        status, body = decode.post("/v1/completions", long)
        assert status == 500 and "--disaggregation-host-staging-tokens" in body["error"]["message"]
        wait_until(lambda: decode.metric("vllm:kv_cache_usage_perc") == 0, 10, "blocks freed")


def test_a_fake_backend_decode_moves_nothing_and_makes_up_the_first_token(
    checkpoint, tmp_path_factory
):
    """SGLang's `fake` backend (decode benchmarks): no prefill, no agents, the first token a
    hash of the request's engine id."""
    from tp_engine.server.rank0.disagg.decode import _made_up_token

    env, tmpdir = pd_env()
    _, decode_cmd, _ = doc_commands()
    cmd = [*swap(decode_cmd, {"30001": "0"}), "--model", str(checkpoint), "--served-model-name",
           MODEL, "--disaggregation-transfer-backend", "fake", "--num-kv-blocks", "32"]  # fmt: skip
    decode = Server(cmd, env, tmp_path_factory.mktemp("fake") / "decode.log").wait_ready()
    try:
        body = completion(PROMPTS[0], bootstrap_host="127.0.0.1", bootstrap_port=1,
                          bootstrap_room=5)  # fmt: skip
        status, resp = decode.post("/v1/completions", body)
        assert status == 200, resp
        tokens = resp["choices"][0]["token_ids"]
        assert len(tokens) == MAX_TOKENS
        vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
        assert tokens[0] == _made_up_token(f"{resp['id']}-0", vocab)
        assert decode.metric("tp_engine:prompt_tokens_computed_total") == 0
    finally:
        decode.stop()
        shutil.rmtree(tmpdir, ignore_errors=True)
