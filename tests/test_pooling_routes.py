"""The pooling routes without processes: the API app in front of a scripted rank 0.

`ScriptedEngine` answers each AddRequest at once, as rank 0 would: accepted, then one Delta
whose pooled vector is a fixed function of the prompt (an embedding honouring `dimensions`, or a
score growing with the prompt's length), so that the tests know every answer in advance. What
the real engine computes is `test_pooling_server`'s business.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import msgspec
import numpy as np
import pytest
from starlette.testclient import TestClient

from tp_engine.lora_request import LoRARequest
from tp_engine.server.api.app import build_app
from tp_engine.server.api.engine_client import ACCEPTED
from tp_engine.server.api.metrics import ServerMetrics
from tp_engine.server.messages import Delta, Hello, Rejected

SIZE = 8  # pooled size (the hidden size of the scripted model)
MAX_LEN = 48
VOCAB = 700


def embedding_of(ids: list[int], dimensions: int | None = None) -> np.ndarray:
    v = np.sin(np.arange(SIZE) + sum(ids)).astype(np.float32)[: dimensions or SIZE]
    return v / np.linalg.norm(v)


def class_of(ids: list[int], engine: ScriptedEngine) -> int:
    """The class a scripted classifier picks: one by prompt length."""
    return len(ids) % len(engine.hello.class_labels)


def score_of(ids: list[int]) -> float:
    return float(np.float32(1 - 1 / (1 + len(ids))))


def raw_if_asked(pooled: np.ndarray, pooling_params: dict[str, Any]) -> np.ndarray:
    """What rank 0 answers without its last step: an embedding not normalised (norm 3 here),
    scores without the activation (1 less here)."""
    if pooling_params.get("normalize") is False:
        pooled = pooled * 3
    if pooling_params.get("use_activation") is False:
        pooled = pooled - 1
    return pooled


class ScriptedEngine:
    """What `EngineClient` offers the routes, with rank 0 scripted."""

    def __init__(self, hello: Hello) -> None:
        self.hello = hello
        self.metrics = ServerMetrics(hello.served_model_names[0])
        self.trace = None  # the EngineClient's request trace: off (`request_trace`)
        self.dead: str | None = None
        self.draining = False
        self.sent: list[tuple[list[int], dict[str, Any]]] = []
        self.refuse: str | None = None  # rank 0's 400 for the next request

    def add(self, queue: asyncio.Queue, request_id, ids, sampling_params, pooling_params=None):
        self.sent.append((ids, pooling_params))
        if self.refuse is not None:
            queue.put_nowait((request_id, Rejected(request_id, 400, self.refuse)))
            return
        if pooling_params["task"] == "embed":
            pooled = embedding_of(ids, pooling_params.get("dimensions"))
        elif pooling_params["task"] == "classify" and self.hello.class_labels:
            pooled = np.eye(len(self.hello.class_labels), dtype=np.float32)[class_of(ids, self)]
        else:
            pooled = np.array([score_of(ids)], np.float32)
        pooled = raw_if_asked(pooled, pooling_params)
        queue.put_nowait((request_id, ACCEPTED))
        delta = Delta(request_id, 0, [], "stop", None, 0, 0.0, None, None, pooled.tobytes())
        queue.put_nowait((request_id, delta))

    def abort(self, request_id, sample_indices=None, *, stopped=False) -> None:
        pass

    def release(self, request_id) -> None:
        pass


def hello(
    model_dir: str, tasks: list[str], matryoshka: bool = True, labels: list[str] | None = None
) -> Hello:
    return Hello(
        model_dir, ["m"], MAX_LEN, VOCAB, {}, None, 1,
        supported_tasks=tasks, pooled_size=SIZE, is_matryoshka=matryoshka,
        class_labels=labels or [],
    )  # fmt: skip


def pair_tokens(tokenizer, query: str, document: str, instruction: str | None) -> list[int]:
    text = f"<{instruction or 'default'}> {query} | {document}"
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tp_engine.testing import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def app_for(
    tokenizer, tasks: list[str], matryoshka: bool = True, labels: list[str] | None = None
) -> tuple[TestClient, Any]:
    engine = ScriptedEngine(hello("/m", tasks, matryoshka, labels))
    app = build_app(engine, tokenizer, pair_tokens=pair_tokens)  # type: ignore[arg-type]
    return TestClient(app, base_url="http://localhost"), engine


def error_of(response) -> tuple[int, str | None, str]:
    error = response.json()["error"]
    return response.status_code, error["param"], error["message"]


def test_routes_follow_the_models_tasks(tokenizer):
    generate, _ = app_for(tokenizer, ["generate"])
    for path in ("/v1/embeddings", "/pooling", "/classify", "/score", "/rerank", "/v2/rerank"):
        r = generate.post(path, json={"input": "a"})
        assert r.status_code == 404, path
        assert r.json()["error"]["message"] == f"no route POST {path}"
    assert generate.post("/v1/completions", json={}).status_code == 400  # there, body refused

    embed, engine = app_for(tokenizer, ["embed", "score"])
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/classify"):
        assert error_of(embed.post(path, json={}))[0] == 404, path
    assert embed.post("/v1/embeddings", json={"input": "a"}).status_code == 200
    # SGLang's deep health check pools a token where it cannot generate one.
    assert embed.get("/health_generate").status_code == 200
    assert engine.sent[-1] == ([0], {"task": "embed"})

    # SGLang's /model_info tells a router whether the worker generates.
    assert generate.get("/model_info").json()["is_generation"] is True
    assert embed.get("/model_info").json()["is_generation"] is False

    classify, _ = app_for(tokenizer, ["classify", "score"])
    assert classify.post("/v1/embeddings", json={"input": "a"}).status_code == 404
    r = classify.post("/classify", json={"input": ["a", "bb cc"]})
    assert [d["num_classes"] for d in r.json()["data"]] == [1, 1]
    assert [d["label"] for d in r.json()["data"]] == ["LABEL_0", "LABEL_0"]  # vLLM's default


def test_classify_labels_come_from_the_checkpoint(tokenizer):
    """The checkpoint's id2label (carried in Hello) names the most likely class."""
    labels = ["negative", "neutral", "positive"]
    client, engine = app_for(tokenizer, ["classify"], labels=labels)
    texts = ["a", "a b", "a b c", "a b c d"]
    data = client.post("/classify", json={"input": texts}).json()["data"]
    picked = [class_of(ids, engine) for ids, _ in engine.sent]
    assert len(set(picked)) == 3  # every class once at least
    assert [d["label"] for d in data] == [labels[i] for i in picked]
    assert [d["num_classes"] for d in data] == [3] * 4


def test_embeddings_as_floats_and_base64(tokenizer):
    client, engine = app_for(tokenizer, ["embed", "score"])
    texts = ["a", "hello world, hello", "x y z"]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    floats = client.post("/v1/embeddings", json={"input": texts, "model": "m"}).json()
    b64 = client.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64"}).json()
    assert floats["object"] == "list" and floats["model"] == "m"
    assert floats["id"].startswith("embd-")
    n = sum(map(len, ids))
    assert floats["usage"] == {"prompt_tokens": n, "total_tokens": n}
    counted = engine.metrics.registry.get_sample_value
    assert counted("vllm:prompt_tokens_total", {"model_name": "m"}) == 2 * n  # both requests
    assert (
        counted("vllm:request_success_total", {"model_name": "m", "finished_reason": "stop"}) == 6
    )
    for i, (f, b) in enumerate(zip(floats["data"], b64["data"], strict=True)):
        assert f["index"] == b["index"] == i and f["object"] == "embedding"
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, embedding_of(ids[i]))
        np.testing.assert_array_equal(np.float32(f["embedding"]), embedding_of(ids[i]))
    # Token ids go as given; dimensions travel in the PoolingParams fields.
    r = client.post("/v1/embeddings", json={"input": [[5, 6], [7]], "dimensions": 3}).json()
    assert [len(d["embedding"]) for d in r["data"]] == [3, 3]
    assert engine.sent[-1] == ([7], {"task": "embed", "dimensions": 3})
    pooled = client.post("/pooling", json={"input": [5, 6]}).json()["data"][0]
    assert pooled["object"] == "pooling"
    np.testing.assert_array_equal(np.float32(pooled["data"]), embedding_of([5, 6]))


REFUSALS = [
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": [[1], []]}, "input"),
    ("/v1/embeddings", {"input": ["a", ""]}, "input"),
    ("/v1/embeddings", {"input": "a", "dimensions": 0}, "dimensions"),
    ("/v1/embeddings", {"input": "a", "dimensions": SIZE + 1}, "dimensions"),
    ("/v1/embeddings", {"input": "a", "encoding_format": "hex"}, "encoding_format"),
    ("/v1/embeddings", {"input": "word " * (MAX_LEN + 1)}, "input"),
    ("/v1/embeddings", {"input": [1] * (MAX_LEN + 1)}, "input"),
    ("/v1/embeddings", {"input": [VOCAB]}, "input"),
    ("/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ("/rerank", {"query": "q", "documents": ["word " * MAX_LEN]}, "documents"),
    ("/score", {"queries": ["a", "b"], "documents": ["a", "b", "c"]}, "documents"),
    ("/score", {"queries": "a", "documents": []}, "documents"),
    ("/score", {"text_1": "a"}, "queries"),
    ("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ("/pooling", {"input": "a", "truncate_prompt_tokens": MAX_LEN + 1}, "truncate_prompt_tokens"),
    ("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": "5"}, "truncate_prompt_tokens"),
    ("/classify", {"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    (
        "/score",
        {"queries": "a", "documents": ["b"], "truncate_prompt_tokens": MAX_LEN + 1},
        "truncate_prompt_tokens",
    ),
    (
        "/v2/rerank",
        {"query": "q", "documents": ["a"], "truncate_prompt_tokens": -3},
        "truncate_prompt_tokens",
    ),
    ("/v1/embeddings", {"input": "a", "normalize": "no"}, "normalize"),
    ("/classify", {"input": "a", "use_activation": "no"}, "use_activation"),
    ("/classify", {"input": "a", "use_activation": True, "activation": False}, "activation"),
    ("/score", {"queries": "a", "documents": ["b"], "activation": 0}, "activation"),
    (
        "/rerank",
        {"query": "q", "documents": ["a"], "use_activation": None, "activation": 1},
        "activation",
    ),
]


@pytest.mark.parametrize("tasks", [["embed", "score"], ["classify", "score"]], ids=str)
def test_wrong_fields_are_400s_naming_them(tokenizer, tasks):
    client, engine = app_for(tokenizer, tasks)
    for path, body, param in REFUSALS:
        if (path == "/v1/embeddings" and "embed" not in tasks) or (
            path == "/classify" and "classify" not in tasks
        ):
            continue
        status, named, message = error_of(client.post(path, json=body))
        assert (status, named) == (400, param), (path, body, message)
    assert engine.sent == []  # none of them reached rank 0
    assert (
        error_of(client.post("/v1/rerank", json={"query": "q", "documents": ["a"], "model": "x"}))[
            0
        ]
        == 404
    )
    engine.refuse = "the engine says no"  # rank 0's own refusal passes through as a 400
    assert error_of(client.post("/score", json={"queries": "a", "documents": ["b"]})) == (
        400, None, "the engine says no",
    )  # fmt: skip


def test_truncate_prompt_tokens_keeps_the_last_tokens(tokenizer):
    """vLLM's `truncate_prompt_tokens`: each prompt's last k tokens reach rank 0, so an input
    too long for max_model_len is served; -1 stands for max_model_len."""
    long_text = " ".join(f"w{i}" for i in range(MAX_LEN + 5))
    long_ids = tokenizer(long_text)["input_ids"]
    assert len(long_ids) > MAX_LEN
    client, engine = app_for(tokenizer, ["embed", "score"])
    for path in ("/v1/embeddings", "/pooling"):
        r = client.post(path, json={"input": [long_text, "a"], "truncate_prompt_tokens": 5})
        assert r.status_code == 200, r.text
        assert [ids for ids, _ in engine.sent[-2:]] == [long_ids[-5:], tokenizer("a")["input_ids"]]
        assert r.json()["usage"]["prompt_tokens"] == 5 + len(tokenizer("a")["input_ids"])
    client.post("/v1/embeddings", json={"input": [long_ids], "truncate_prompt_tokens": -1})
    assert engine.sent[-1][0] == long_ids[-MAX_LEN:]
    client.post(
        "/score", json={"queries": "q", "documents": [long_text], "truncate_prompt_tokens": 3}
    )
    assert engine.sent[-1][0] == long_ids[-3:]

    cross, engine = app_for(tokenizer, ["classify", "score"])
    assert (
        cross.post("/classify", json={"input": long_text, "truncate_prompt_tokens": 4}).status_code
        == 200
    )
    assert engine.sent[-1][0] == long_ids[-4:]
    for path in ("/rerank", "/v1/rerank", "/v2/rerank", "/score"):
        body = {"query": "q", "documents": [long_text], "truncate_prompt_tokens": 6}
        if path == "/score":
            body = {"queries": "q", "documents": [long_text], "truncate_prompt_tokens": 6}
        assert cross.post(path, json=body).status_code == 200, path
        assert engine.sent[-1][0] == pair_tokens(tokenizer, "q", long_text, None)[-6:], path


def test_normalize_and_use_activation_reach_rank_0(tokenizer):
    """vLLM's `normalize` and `use_activation` (or its older name `activation`) travel as the
    `PoolingParams` fields; unset, rank 0 applies the model's default."""
    ids = tokenizer("a b")["input_ids"]
    client, engine = app_for(tokenizer, ["embed", "score"])
    for path, key in (("/v1/embeddings", "embedding"), ("/pooling", "data")):
        for normalize, norm in ((False, 3.0), (True, 1.0)):
            r = client.post(path, json={"input": "a b", "normalize": normalize})
            assert np.linalg.norm(r.json()["data"][0][key]) == pytest.approx(norm, rel=1e-5)
            assert engine.sent[-1] == (
                ids,
                {"task": "embed", "dimensions": None, "normalize": normalize},
            )
    client.post("/v1/embeddings", json={"input": "a b"})
    assert "normalize" not in engine.sent[-1][1]
    client.post("/score", json={"queries": "a", "documents": ["b"], "use_activation": False})
    assert engine.sent[-1][1] == {"task": "embed"}  # a cosine has no activation

    cross, engine = app_for(tokenizer, ["classify", "score"])
    for name in ("use_activation", "activation"):
        r = cross.post("/classify", json={"input": "a b", name: False}).json()
        assert engine.sent[-1] == (ids, {"task": "classify", "use_activation": False})
        assert r["data"][0]["probs"] == [pytest.approx(score_of(ids) - 1)]
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            r = cross.post(path, json={"query": "q", "documents": ["d"], name: False}).json()
            assert engine.sent[-1][1] == {"task": "score", "use_activation": False}, path
            prompt = pair_tokens(tokenizer, "q", "d", None)
            assert r["results"][0]["relevance_score"] == pytest.approx(score_of(prompt) - 1)
        r = cross.post("/score", json={"queries": "q", "documents": ["d"], name: True}).json()
        assert engine.sent[-1][1] == {"task": "score", "use_activation": True}
        assert r["data"][0]["score"] == pytest.approx(score_of(prompt))
    cross.post("/classify", json={"input": "a b", "use_activation": False, "activation": False})
    assert engine.sent[-1][1] == {"task": "classify", "use_activation": False}
    cross.post("/classify", json={"input": "a b"})
    assert engine.sent[-1][1] == {"task": "classify"}


def test_dimensions_need_a_matryoshka_model(tokenizer):
    client, _ = app_for(tokenizer, ["embed", "score"], matryoshka=False)
    status, param, message = error_of(
        client.post("/v1/embeddings", json={"input": "a", "dimensions": 4})
    )
    assert (status, param) == (400, "dimensions")
    assert "does not support Matryoshka embeddings" in message and "is_matryoshka" in message


def test_rerank_and_score_shapes(tokenizer):
    docs = ["b", "bb bb bb bb", "bb bb"]
    cross, engine = app_for(tokenizer, ["classify", "score"])
    body = {"query": "q", "documents": docs, "instruction": "find b", "top_n": 2}
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = cross.post(path, json=body).json()
        assert r["id"].startswith("rerank-") and r["model"] == "m"
        assert [x["index"] for x in r["results"]] == [1, 2]  # longest prompt scores highest
        assert [x["document"]["text"] for x in r["results"]] == [docs[1], docs[2]]
        prompt = pair_tokens(tokenizer, "q", docs[1], "find b")
        assert r["results"][0]["relevance_score"] == score_of(prompt)
        assert engine.sent[-1][1] == {"task": "score"}
    all_docs = cross.post("/rerank", json={**body, "top_n": 0, "return_documents": False}).json()
    assert [x["index"] for x in all_docs["results"]] == [1, 2, 0]
    assert "document" not in all_docs["results"][0]
    n = sum(len(ids) for ids, _ in engine.sent[-3:])
    assert all_docs["usage"] == {"prompt_tokens": n, "total_tokens": n}
    score = cross.post(
        "/score", json={"text_1": "q", "text_2": docs, "instruction": "find b"}
    ).json()
    assert [d["index"] for d in score["data"]] == [0, 1, 2]
    assert [d["score"] for d in score["data"]] == [
        all_docs["results"][[x["index"] for x in all_docs["results"]].index(i)]["relevance_score"]
        for i in range(3)
    ]

    embed, engine = app_for(tokenizer, ["embed", "score"])
    score = embed.post("/score", json={"queries": ["q", "b"], "documents": ["b", "b"]}).json()
    assert score["data"][1]["score"] == pytest.approx(1.0)  # the same text: cosine 1
    q, b = (embedding_of(tokenizer(t)["input_ids"]) for t in ("q", "b"))
    assert score["data"][0]["score"] == pytest.approx(float(q @ b), abs=1e-6)
    assert len(engine.sent) == 2  # each distinct text embedded once


def test_tasks_rank_0_announces():
    from rank_worker.models.layers.rope_spec import RopeSpec
    from rank_worker.models.model_spec import HeadSpec, ModelSpec
    from tp_engine.server.rank0.main import supported_tasks

    rope = RopeSpec("default", 16, 10000.0, 512)

    def tasks(task: str, head: HeadSpec) -> list[str]:
        return supported_tasks(ModelSpec(task, head, rope, SIZE))  # type: ignore[arg-type]

    assert tasks("generate", HeadSpec()) == ["generate"]
    assert tasks("embed", HeadSpec("last_token")) == ["embed", "score"]
    assert tasks("classify", HeadSpec("token_score", (1, 2))) == ["classify", "score"]
    # Scores need one number per pair: a several-label classifier only classifies.
    assert tasks("classify", HeadSpec("seq_cls", num_labels=3)) == ["classify"]


def test_a_lora_adapters_name_is_refused_not_ignored(tokenizer):
    """Adapters serve generation only (the engine refuses a pooling request with one): a
    pooling route naming an adapter is a 400, not the base model's vectors under its name."""
    engine = ScriptedEngine(hello("/m", ["embed", "score"]))
    engine.hello = msgspec.structs.replace(
        engine.hello, enable_lora=True, lora_modules=[LoRARequest("ad", 1, "/ad", "m")]
    )
    client = TestClient(build_app(engine, tokenizer, pair_tokens=pair_tokens),  # type: ignore[arg-type]
                        base_url="http://localhost")  # fmt: skip
    for path, body in (
        ("/v1/embeddings", {"input": "a"}),
        ("/pooling", {"input": "a"}),
        ("/score", {"queries": "a", "documents": ["b"]}),
        ("/rerank", {"query": "a", "documents": ["b"]}),
    ):
        status, param, message = error_of(client.post(path, json={**body, "model": "ad"}))
        assert (status, param) == (400, "model"), (path, message)
        assert "LoRA adapters serve generation only" in message
    assert engine.sent == []
    assert client.post("/v1/embeddings", json={"input": "a", "model": "m"}).status_code == 200
