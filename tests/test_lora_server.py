"""LoRA adapters through a live server and the official `openai` client: `--lora-modules`
(both forms), the `model` field picks the adapter (greedy ids equal PEFT's), `/v1/models`
lists adapters with `root` and `parent`, an unknown model is vLLM's 404, vLLM's runtime
load/unload routes with their replies and refusals, an unload lets the requests using the
adapter finish, a reload under the same name serves the new adapter (no stale K/V), and the
server serves on through every refusal. The routes are 404 without
`VLLM_ALLOW_RUNTIME_LORA_UPDATING`."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.lora_cases import BASE_CHECKPOINT, MAX_LORA_RANK, build_adapters, build_bad_adapters
from tests.server_harness import Server, serving
from tests.tp_cases import MAX_MODEL_LEN

pytestmark = pytest.mark.slow

PROMPT = [5, 77, 301, 12, 9, 140, 33, 250, 61]  # two full blocks of 4, and one token
MAX_TOKENS = 5
LONG = 40  # tokens of the request an unload lets finish


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> dict[str, Any]:
    from peft import PeftModel

    from tests.lora_cases import load_base
    from tests.moe_cases import hf_greedy
    from tp_engine.testing import build_random_qwen3

    root = tmp_path_factory.mktemp("lora_server")
    base = build_random_qwen3(
        root / "base", max_position_embeddings=MAX_MODEL_LEN, **BASE_CHECKPOINT
    )
    adapters = build_adapters(base, root)
    ref = {}
    for name in (None, *adapters):
        model = load_base(base)
        if name is not None:
            model = PeftModel.from_pretrained(model, adapters[name]).eval()
        ref[name] = hf_greedy(model, [PROMPT], LONG)[0]
    return {"base": base, "adapters": adapters, "ref": ref, "root": root,
            "bad": build_bad_adapters(adapters["a"], root / "bad")}  # fmt: skip


@pytest.fixture(scope="module")
def server(case) -> Iterator[Server]:
    a, b = case["adapters"]["a"], case["adapters"]["b"]
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"
    try:
        yield from serving(
            case["base"], case["root"] / "server.log", "--served-model-name", "base",
            "--enable-lora", "--lora-modules", f"a={a}",
            json.dumps({"name": "b", "path": str(b), "base_model_name": "Qwen/base"}),
            "--max-loras", "2", "--max-lora-rank", str(MAX_LORA_RANK),
            "--block-size", "4", "--num-kv-blocks", "64", "--max-model-len", str(MAX_MODEL_LEN),
        )  # fmt: skip
    finally:
        os.environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING", None)


def client(server: Server) -> Any:
    import openai

    return openai.OpenAI(base_url=f"http://{server.host}:{server.port}/v1", api_key="none")


def complete(server: Server, model: str, max_tokens: int = MAX_TOKENS) -> list[int]:
    out = client(server).completions.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert out.model == model
    return out.choices[0].model_extra["token_ids"]


def admin(server: Server, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    status, raw = server.request(
        "POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    text = raw.decode()
    return status, text if status == 200 else json.loads(text)["error"]


def test_model_field_picks_the_adapter_and_models_lists_them(server, case):
    import openai

    ref = case["ref"]
    cards = {m.id: (m.root, m.parent) for m in client(server).models.list().data}
    assert cards == {
        "base": (str(case["base"]), None),
        "a": (str(case["adapters"]["a"]), "base"),
        "b": (str(case["adapters"]["b"]), "Qwen/base"),
    }
    for model, name in (("base", None), ("a", "a"), ("b", "b")):
        assert complete(server, model) == ref[name][:MAX_TOKENS], model
    stream = client(server).chat.completions.create(
        model="b", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True
    )
    assert {chunk.model for chunk in stream} == {"b"}  # streamed chat names the adapter too
    with pytest.raises(openai.NotFoundError) as err:
        complete(server, "nope")
    assert err.value.body == {
        "message": "The model `nope` does not exist.", "type": "NotFoundError",
        "param": "model", "code": 404,
    }  # fmt: skip


def test_runtime_load_and_unload(server, case):
    ref, paths, bad = case["ref"], case["adapters"], case["bad"]
    c = str(paths["c"])
    assert admin(server, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": c}) == (
        200, "Success: LoRA adapter 'c' added successfully.",
    )  # fmt: skip
    assert complete(server, "c") == ref["c"][:MAX_TOKENS]
    refusals = [
        ({"lora_name": "c", "lora_path": c}, 400,
         "The lora adapter 'c' has already been loaded."),
        ({"lora_name": "x"}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
        ({"lora_name": "x", "lora_path": str(bad["missing"])}, 404,
         f"Loading lora x failed: No adapter found for {bad['missing']}"),
        ({"lora_name": "x", "lora_path": str(bad["rank"])}, 400,
         "LoRA rank 32 is greater than max_lora_rank 16."),
        ({"lora_name": "x", "lora_path": str(bad["dora"])}, 400,
         "vLLM does not yet support DoRA."),
    ]  # fmt: skip
    for body, status, message in refusals:
        got_status, error = admin(server, "/v1/load_lora_adapter", body)
        assert (got_status, error["message"]) == (status, message), body
    assert admin(server, "/v1/unload_lora_adapter", {"lora_name": "c"})[0] == 200
    assert admin(server, "/v1/unload_lora_adapter", {"lora_name": "c"}) == (
        404, {"message": "The lora adapter 'c' cannot be found.", "type": "NotFoundError",
              "param": None, "code": 404},
    )  # fmt: skip
    status, _ = server.post("/v1/completions", {"model": "c", "prompt": PROMPT})
    assert status == 404
    # The name again, b's weights: b's outputs, none of c's cached K/V.
    assert (
        admin(server, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(paths["b"])})[0]
        == 200
    )
    assert complete(server, "c") == ref["b"][:MAX_TOKENS]
    assert complete(server, "base") == ref[None][:MAX_TOKENS]  # served on throughout


def test_unload_lets_running_requests_finish(server, case):
    stream = client(server).completions.create(
        model="a", prompt=PROMPT, max_tokens=LONG, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    ids: list[int] = []
    for chunk in stream:
        if not ids:  # its first token is out: the adapter is in use
            assert admin(server, "/v1/unload_lora_adapter", {"lora_name": "a"})[0] == 200
        ids += chunk.choices[0].model_extra.get("token_ids") or []
    assert ids == case["ref"]["a"]
    # vLLM's gauge saw a running with its two slots (labels sorted by name).
    info = [k for k in server.metrics() if k.startswith("vllm:lora_requests_info{")]
    assert any('max_lora="2"' in k and 'running_lora_adapters="a' in k for k in info), info
    assert server.post("/v1/completions", {"model": "a", "prompt": PROMPT})[0] == 404
