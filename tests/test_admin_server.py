"""The admin routes through a live server (`--enable-weight-updates --enable-sleep-mode`):
pause in each mode with requests in flight and arriving, resume, SGLang's spellings, the key.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.server_harness import Server, serving

pytestmark = pytest.mark.slow

API_KEY = "sk-admin-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG = 200  # tokens: the demo model on CPU takes a second or more for them


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    os.environ.setdefault("TP_ENGINE_CACHE", str(tmp_path_factory.mktemp("cache")))
    from tp_engine.demo import demo_checkpoint_dir

    log = tmp_path_factory.mktemp("log") / "server.log"
    yield from serving(
        demo_checkpoint_dir(), log,
        "--api-key", API_KEY, "--enable-weight-updates", "--enable-sleep-mode",
        "--max-model-len", "256", "--num-kv-blocks", "128",
    )  # fmt: skip


@pytest.fixture(autouse=True)
def serving_again(server):
    yield
    server.request("POST", "/resume", headers=AUTH)


def admin(server: Server, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    headers = {**AUTH, **({"Content-Type": "application/json"} if data else {})}
    status, raw = server.request(method, path, data, headers)
    return status, json.loads(raw) if raw else None


class Streamed(threading.Thread):
    """A streamed completion read chunk by chunk: `first` is set at its first token."""

    def __init__(self, server: Server, max_tokens: int = LONG) -> None:
        super().__init__(daemon=True)
        self.server, self.max_tokens = server, max_tokens
        self.first = threading.Event()
        self.tokens = 0
        self.finish_reason: str | None = None

    def run(self) -> None:
        conn = self.server.connection()
        body = {"prompt": "Hi", "max_tokens": self.max_tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        conn.request("POST", "/v1/completions", json.dumps(body).encode(),
                     {**AUTH, "Content-Type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        for line in resp:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                self.tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                self.first.set()
                self.finish_reason = choice.get("finish_reason") or self.finish_reason
        conn.close()


def test_admin_routes_need_the_key(server):
    for method, path in (("POST", "/pause"), ("GET", "/is_paused"), ("POST", "/sleep"),
                         ("GET", "/get_weight_version"), ("POST", "/pause_generation")):  # fmt: skip
        assert server.request(method, path)[0] == 401, path
    assert admin(server, "GET", "/is_paused") == (200, {"is_paused": False})


def test_requests_sent_while_paused_wait_then_run(server):
    assert admin(server, "POST", "/pause?mode=keep")[0] == 200
    assert admin(server, "GET", "/is_paused") == (200, {"is_paused": True})
    late = Streamed(server, max_tokens=8)
    late.start()
    time.sleep(1.0)
    assert late.is_alive() and not late.first.is_set()
    assert server.get("/health")[0] == 200  # paused is not dead
    assert admin(server, "POST", "/resume")[0] == 200
    late.join(60)
    assert late.tokens == 8 and late.finish_reason == "length"


def test_pause_abort_ends_running_requests_with_their_output(server):
    running = Streamed(server)
    running.start()
    assert running.first.wait(60)
    assert admin(server, "POST", "/pause?mode=abort")[0] == 200
    running.join(30)
    assert running.finish_reason == "abort" and 0 < running.tokens < LONG


def test_pause_wait_answers_once_running_requests_are_done(server):
    running = Streamed(server)
    running.start()
    assert running.first.wait(60)
    assert admin(server, "POST", "/pause?mode=wait")[0] == 200
    running.join(5)  # its last chunk was sent before the pause's reply
    assert not running.is_alive() and running.tokens == LONG
    assert running.finish_reason == "length"


def test_sglang_pause_and_continue(server):
    assert admin(server, "POST", "/pause_generation", {"mode": "in_place"}) == (
        200,
        {"message": "Generation paused successfully.", "status": "ok"},
    )  # fmt: skip  (SGLang's reply)
    assert admin(server, "GET", "/is_paused")[1] == {"is_paused": True}
    assert admin(server, "POST", "/continue_generation")[1]["status"] == "ok"
    assert admin(server, "GET", "/is_paused")[1] == {"is_paused": False}
    status, reply = admin(server, "POST", "/pause_generation", {"mode": "later"})
    assert status == 400 and reply["success"] is False and "'later'" in reply["message"]


def test_unknown_pause_mode_is_a_400_naming_the_modes(server):
    status, reply = admin(server, "POST", "/pause?mode=stop")
    assert status == 400 and "abort, wait, keep" in reply["error"]["message"], reply
    assert admin(server, "GET", "/is_paused")[1] == {"is_paused": False}


def greedy_tokens(server: Server, prompt: str = "Hello") -> list[int]:
    status, resp = server.post(
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
         "return_token_ids": True},
        AUTH,
    )  # fmt: skip
    assert status == 200, resp
    return resp["choices"][0]["token_ids"]


def test_sleep_then_wake_serves_the_same_tokens(server):
    before = greedy_tokens(server)
    assert admin(server, "POST", "/sleep?level=1")[0] == 200
    assert admin(server, "GET", "/is_sleeping") == (200, {"is_sleeping": True})
    late = Streamed(server, max_tokens=4)
    late.start()
    time.sleep(1.0)
    assert late.is_alive() and not late.first.is_set()  # it waits for the wake
    assert server.get("/health")[0] == 200  # asleep is not dead
    assert admin(server, "POST", "/wake_up?tags=weights&tags=kv_cache")[0] == 200
    late.join(60)
    assert late.tokens == 4
    assert admin(server, "GET", "/is_sleeping") == (200, {"is_sleeping": False})
    assert greedy_tokens(server) == before


def test_sglang_memory_occupation_routes(server):
    before = greedy_tokens(server)
    assert admin(server, "POST", "/release_memory_occupation", {})[1]["success"] is True
    assert admin(server, "GET", "/is_sleeping")[1] == {"is_sleeping": True}
    assert admin(server, "POST", "/resume_memory_occupation", {})[1]["success"] is True
    assert greedy_tokens(server) == before
    status, reply = admin(server, "POST", "/sleep?level=3")
    assert status == 400 and "level" in reply["error"]["message"], reply


def test_update_from_a_trainer_then_completions_on_the_new_weights(server, tmp_path):
    """SGLang's RL flow through the server: a trainer process hosts the group's store and
    joins as its rank 0, the engine joins (/init_weights_update_group), the trainer broadcasts
    checkpoint B while /update_weights_from_distributed receives it; then completions through
    the official client are transformers' greedy tokens on B."""
    import openai

    from tests.tp_cases import hf_greedy
    from tests.weight_trainer import checkpoint_metas, spawn_trainer
    from tp_engine.demo import DEMO_SHAPE
    from tp_engine.testing import build_random_qwen3

    b = build_random_qwen3(tmp_path / "b", **{**DEMO_SHAPE, "seed": 11})
    metas = checkpoint_metas(b)
    trainer = spawn_trainer(2, "rl")
    commands, replies, port = trainer.commands, trainer.replies, trainer.port
    try:
        group = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                 "world_size": 2, "group_name": "rl"}  # fmt: skip
        assert admin(server, "POST", "/init_weights_update_group", group)[1]["success"] is True
        assert replies.get(timeout=60) == ("ready",)
        commands.put(("send", str(b), metas))
        update = {"names": [m[0] for m in metas], "dtypes": [m[1] for m in metas],
                  "shapes": [m[2] for m in metas], "group_name": "rl", "weight_version": "step-1"}  # fmt: skip
        status, reply = admin(server, "POST", "/update_weights_from_distributed", update)
        assert (status, reply["success"]) == (200, True), reply
        assert replies.get(timeout=60)[0] == "sent"
        assert admin(server, "GET", "/get_weight_version") == (200, {"weight_version": "step-1"})

        client = openai.OpenAI(base_url=f"http://{server.host}:{server.port}/v1", api_key=API_KEY)
        prompt = [5, 17, 33, 2, 9]
        done = client.completions.create(
            model=client.models.list().data[0].id, prompt=prompt, max_tokens=6, temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        assert done.choices[0].token_ids == hf_greedy(b, [prompt], 6)[0]
        destroy = {"group_name": "rl"}
        assert admin(server, "POST", "/destroy_weights_update_group", destroy)[0] == 200
    finally:
        trainer.stop()
