"""The pooling routes, for real: `launch/serve.py` serving Qwen3-Embedding and Qwen3-Reranker in
their published layouts (`tests/pooling_cases.py`), the embedder on one rank and the reranker
on two, each started once for the module.

Embeddings go through the official `openai` client (which asks for base64 unless told "float")
and must equal sentence-transformers' `encode` on the same checkpoint; reranker scores must
equal `LLM.score` on the same checkpoint. Then the refusals, each a 400 naming its field, the
route split (404) and the API key, after which the server still answers as before.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.pooling_cases import (
    EMBED_QUERY_PROMPT,
    RERANKER_OVERRIDES,
    build_embedding_checkpoint,
    build_reranker_checkpoint,
    sentence_transformers_vectors,
)
from tests.server_harness import serving

pytestmark = pytest.mark.slow

API_KEY = "sk-pool"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 384
HIDDEN = 64  # the tiny checkpoints' hidden size
COSINE_MIN = 0.99999
# A small budget: the long document is prefilled in chunks; its twin then hits the prefix cache.
ENGINE_ARGS = (
    "--max-model-len", str(MAX_MODEL_LEN), "--block-size", "4", "--num-kv-blocks", "256",
    "--max-num-batched-tokens", "32", "--max-num-seqs", "8", "--api-key", API_KEY,
)  # fmt: skip

QUERIES = ["what is a cache"]
DOCUMENTS = [
    "a",
    "The cache keeps the keys and values of every token that was already computed.",
    " ".join(["Once upon a time there was a quiet village by a river."] * 6) + " The end.",
    " ".join(["Once upon a time there was a quiet village by a river."] * 6) + " Or not.",
]


@pytest.fixture(scope="module")
def embed_case(tmp_path_factory):
    from sentence_transformers import SentenceTransformer

    path = build_embedding_checkpoint(tmp_path_factory.mktemp("embed") / "qwen3-embedding")
    st = SentenceTransformer(str(path), device="cpu")

    def encode(**kw) -> torch.Tensor:
        return sentence_transformers_vectors(st, QUERIES, DOCUMENTS, **kw)

    texts = [EMBED_QUERY_PROMPT + q for q in QUERIES] + DOCUMENTS
    return dict(
        path=path,
        texts=texts,
        full=encode(),
        cut16=encode(truncate_dim=16, normalize_embeddings=True),
        num_tokens=sum(len(st.tokenizer(t)["input_ids"]) for t in texts),
    )


@pytest.fixture(scope="module")
def embed_server(embed_case, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "embed.log"
    yield from serving(
        embed_case["path"], log, *ENGINE_ARGS, "--hf-overrides", '{"is_matryoshka": true}'
    )


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    return build_reranker_checkpoint(tmp_path_factory.mktemp("rerank") / "reranker", tied=True)


@pytest.fixture(scope="module")
def rerank_server(reranker_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "rerank.log"
    overrides = json.dumps(RERANKER_OVERRIDES)
    yield from serving(
        reranker_dir, log, *ENGINE_ARGS, "--runner", "pooling", "--hf-overrides", overrides,
        "--tensor-parallel-size", "2",
    )  # fmt: skip


def openai_client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"http://{server.host}:{server.port}/v1", api_key=API_KEY)


def assert_close(got: list[list[float]], want: torch.Tensor, what: str) -> None:
    got_t = torch.tensor(got)
    assert got_t.shape == want.shape, what
    cos = torch.nn.functional.cosine_similarity(got_t, want, dim=-1)
    assert cos.min() >= COSINE_MIN, f"{what}: cosines {cos.tolist()}"


def test_openai_client_embeddings_equal_sentence_transformers(embed_server, embed_case):
    client = openai_client(embed_server)
    model = client.models.list().data[0].id
    default = client.embeddings.create(model=model, input=embed_case["texts"])  # base64
    floats = client.embeddings.create(
        model=model, input=embed_case["texts"], encoding_format="float"
    )
    for resp, what in ((default, "base64"), (floats, "float")):
        assert [d.index for d in resp.data] == list(range(len(embed_case["texts"])))
        assert_close([d.embedding for d in resp.data], embed_case["full"], what)
        assert resp.usage.prompt_tokens == resp.usage.total_tokens == embed_case["num_tokens"]
        assert resp.model == model
    cut = client.embeddings.create(model=model, input=embed_case["texts"], dimensions=16)
    assert_close([d.embedding for d in cut.data], embed_case["cut16"], "dimensions=16")
    # One request per text, all at once: they share the engine's steps and still each equal
    # sentence-transformers.
    with ThreadPoolExecutor(len(embed_case["texts"])) as pool:
        alone = list(
            pool.map(
                lambda t: client.embeddings.create(model=model, input=t).data[0].embedding,
                embed_case["texts"],
            )
        )
    assert_close(alone, embed_case["full"], "concurrent requests")


REFUSALS = [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "dimensions": HIDDEN + 1}, "dimensions"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
    ({"input": [5] * (MAX_MODEL_LEN + 1)}, "input"),
]


def test_refusals_and_the_route_split_leave_the_server_serving(embed_server, embed_case):
    before = embed_server.post("/v1/embeddings", {"input": DOCUMENTS[1]}, AUTH)
    assert before[0] == 200, before
    for body, param in REFUSALS:
        status, resp = embed_server.post("/v1/embeddings", body, AUTH)
        assert (status, resp["error"]["param"]) == (400, param), (body, resp)
    for path, body, param in [
        ("/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ]:
        status, resp = embed_server.post(path, body, AUTH)
        assert (status, resp["error"]["param"]) == (400, param), (path, resp)
    for path in ("/v1/completions", "/v1/chat/completions", "/classify"):
        status, resp = embed_server.post(path, {"prompt": "a"}, AUTH)
        assert status == 404 and resp["error"]["message"] == f"no route POST {path}"
    assert embed_server.post("/v1/embeddings", {"input": "a"})[0] == 401
    assert embed_server.get("/health_generate", AUTH)[0] == 200
    assert embed_server.post("/score", {"queries": "a", "documents": ["b"]})[0] == 401
    after = embed_server.post("/v1/embeddings", {"input": DOCUMENTS[1]}, AUTH)
    assert after == (200, {**before[1], "id": after[1]["id"], "created": after[1]["created"]})
    # An embedding model's score: the cosine of the two embeddings.
    status, score = embed_server.post(
        "/score", {"queries": DOCUMENTS[1], "documents": DOCUMENTS[1:3]}, AUTH
    )
    full = embed_case["full"]
    want = torch.nn.functional.cosine_similarity(full[2], full[2:4], dim=-1)
    assert [d["index"] for d in score["data"]] == [0, 1]
    assert [d["score"] for d in score["data"]] == pytest.approx(want.tolist(), abs=1e-5)


def test_rerank_and_score_equal_llm_score(rerank_server, reranker_dir):
    from tp_engine import LLM

    instruction = "Find passages about caches"
    llm = LLM(str(reranker_dir), runner="pooling", hf_overrides=RERANKER_OVERRIDES)
    try:
        want = [o.outputs.score for o in llm.score(QUERIES[0], DOCUMENTS, instruction=instruction)]
        default = [o.outputs.score for o in llm.score(QUERIES[0], DOCUMENTS[:2])]
    finally:
        llm.shutdown()
    body = {"query": QUERIES[0], "documents": DOCUMENTS, "instruction": instruction, "top_n": 3}
    best_first = sorted(range(len(DOCUMENTS)), key=lambda i: want[i], reverse=True)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        status, resp = rerank_server.post(path, body, AUTH)
        assert status == 200, resp
        assert [r["index"] for r in resp["results"]] == best_first[:3], path
        for r in resp["results"]:
            assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-5)
            assert r["document"] == {"text": DOCUMENTS[r["index"]]}
        assert resp["usage"]["prompt_tokens"] == resp["usage"]["total_tokens"] > 0
    status, resp = rerank_server.post(
        "/score", {"text_1": QUERIES[0], "text_2": DOCUMENTS[:2]}, AUTH
    )
    assert status == 200 and [d["index"] for d in resp["data"]] == [0, 1]
    assert [d["score"] for d in resp["data"]] == pytest.approx(default, abs=1e-5)
    assert rerank_server.post("/v1/embeddings", {"input": "a"}, AUTH)[0] == 404
