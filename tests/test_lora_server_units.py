"""The server's LoRA parts without processes: --lora-modules parsing, the model registry
(adapters by `model`, /v1/models cards, vLLM's 404), wire messages and the control ops'
statuses."""

from __future__ import annotations

import pytest

from tp_engine.lora_request import LoRARequest
from tp_engine.server.api.http_errors import APIError
from tp_engine.server.api.models import ServedModels
from tp_engine.server.args import build_parser, engine_config, server_args
from tp_engine.server.messages import AddRequest, Hello, decode, encode
from tp_engine.server.rank0.control_ops import run_op


def test_lora_flags_and_modules_parse_as_vllm():
    args = build_parser().parse_args([
        "--lora-modules", "a=/p/a",
        '{"name": "b", "path": "/p/b", "base_model_name": "Qwen/Qwen3-8B"}',
        "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "3",
    ])  # fmt: skip
    config = engine_config(args, 1)
    assert config.enable_lora and (config.max_loras, config.max_lora_rank) == (2, 8)
    assert config.max_cpu_loras == 3
    assert server_args(args).lora_modules == [
        LoRARequest("a", 1, "/p/a"),
        LoRARequest("b", 2, "/p/b", "Qwen/Qwen3-8B"),
    ]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--lora-modules", "{not json"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--max-lora-rank", "7"])
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        engine_config(build_parser().parse_args(["--max-loras", "2", "--max-cpu-loras", "1"]), 1)
    dup = build_parser().parse_args(["--lora-modules", "a=/x", "a=/y"])
    with pytest.raises(ValueError, match="must differ"):
        server_args(dup)


def test_model_field_picks_the_adapter_and_models_lists_them():
    hello = Hello(
        "/m", ["base"], 64, 100, {}, None, 1, enable_lora=True,
        lora_modules=[LoRARequest("a", 1, "/p/a"), LoRARequest("b", 2, "/p/b", "Qwen/Qwen3-8B")],
    )  # fmt: skip
    assert decode(encode(hello)) == hello
    models = ServedModels(hello)
    assert models.resolve(None) is None and models.resolve("base") is None
    assert models.resolve("b") == LoRARequest("b", 2, "/p/b", "Qwen/Qwen3-8B")
    with pytest.raises(APIError) as err:
        models.resolve("nope")
    assert err.value.status == 404
    assert err.value.body() == {
        "error": {
            "message": "The model `nope` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    cards = {c["id"]: (c["root"], c["parent"]) for c in models.cards()}
    assert cards == {"base": ("/m", None), "a": ("/p/a", "base"), "b": ("/p/b", "Qwen/Qwen3-8B")}
    # Ids of run-time loads follow the static ones and are never reused.
    assert [models.new_adapter(n, "/q").lora_int_id for n in "cd"] == [3, 4]
    add = AddRequest("r", [1, 2], {}, lora_request=models.resolve("a"))
    assert decode(encode(add)) == add and decode(encode(add)).lora_request == models.resolve("a")


class FakeEngine:
    """What the LoRA ops call."""

    def __init__(self) -> None:
        self.loaded: set[int] = set()

    def add_lora(self, request: LoRARequest) -> bool:
        if request.lora_path == "/missing":
            from tp_engine.features.lora.registry import LoRAAdapterNotFoundError

            raise LoRAAdapterNotFoundError(
                f"Loading lora {request.lora_name} failed: No adapter found for /missing"
            )
        if request.lora_path == "/big":
            raise ValueError("LoRA rank 64 is greater than max_lora_rank 16.")
        if request.lora_int_id in self.loaded:
            return False
        self.loaded.add(request.lora_int_id)
        return True


def test_lora_control_ops_answer_vllm_statuses():
    engine = FakeEngine()
    load = {"lora_name": "a", "lora_int_id": 1, "lora_path": "/p/a"}
    assert run_op(engine, "load_lora_adapter", load).status == 200  # type: ignore[arg-type]
    again = run_op(engine, "load_lora_adapter", load)  # type: ignore[arg-type]
    assert (again.status, again.message) == (400, "The lora adapter 'a' has already been loaded.")
    missing_path = {**load, "lora_int_id": 2, "lora_path": "/missing"}
    missing = run_op(engine, "load_lora_adapter", missing_path)  # type: ignore[arg-type]
    assert missing.status == 404
    assert missing.message == "Loading lora a failed: No adapter found for /missing"
    too_big = {**load, "lora_int_id": 3, "lora_path": "/big"}
    big = run_op(engine, "load_lora_adapter", too_big)  # type: ignore[arg-type]
    assert (big.status, big.message) == (400, "LoRA rank 64 is greater than max_lora_rank 16.")


@pytest.mark.parametrize("env", [None, "0", "true", "1"])
def test_runtime_routes_exist_only_when_the_env_allows(env, monkeypatch, tmp_path):
    from fastapi.testclient import TestClient

    from tp_engine.server.api.app import build_app
    from tp_engine.testing import build_tokenizer

    if env is None:
        monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    else:
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", env)

    class Client:  # what build_app reads before any request reaches the engine
        hello = Hello("/m", ["base"], 64, 640, {}, None, 1, enable_lora=True)

    app = build_app(Client(), build_tokenizer(tmp_path))  # type: ignore[arg-type]
    http = TestClient(app, base_url="http://localhost")  # a Host the guard answers
    status = http.post("/v1/unload_lora_adapter", json={}).status_code
    assert status == (400 if env in ("true", "1") else 404)


def test_an_unload_rank_0_fails_keeps_the_name_served(monkeypatch, tmp_path):
    """The unload route forgets the name at once; when rank 0 fails the unload (here a 503)
    the adapter is still served there, so the name comes back. Rank 0's own 404 (it had the
    adapter no more) leaves it forgotten."""
    from fastapi.testclient import TestClient

    from tp_engine.server.api.app import build_app
    from tp_engine.server.messages import ControlReply
    from tp_engine.testing import build_tokenizer

    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")

    class Client:
        hello = Hello("/m", ["base"], 64, 640, {}, None, 1, enable_lora=True,
                      lora_modules=[LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")])  # fmt: skip
        status = 503

        async def control(self, op: str, args: dict) -> ControlReply:
            return ControlReply(0, self.status, "no", {})

    client = Client()
    http = TestClient(build_app(client, build_tokenizer(tmp_path)), base_url="http://localhost")  # type: ignore[arg-type]

    def served() -> set[str]:
        return {card["id"] for card in http.get("/v1/models").json()["data"]}

    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 503
    assert served() == {"base", "a", "b"}
    client.status = 404
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 404
    assert served() == {"base", "a"}
