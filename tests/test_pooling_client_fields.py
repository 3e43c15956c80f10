"""What clients written elsewhere send to the pooling routes, before a scripted rank 0
(`test_pooling_routes`' `ScriptedEngine`): each test checks the token ids that reach rank 0.

- vLLM's chat embedding (`messages` on /v1/embeddings): the chat template's text, tokenized
  without adding special tokens (the template wrote them).
- Rerank documents as `{"text": ...}` objects (Jina, Cohere's v1 client), and Cohere's
  `max_tokens_per_doc`: each document cut to its first k tokens before it is scored.
- Reranker texts that carry the template already (vLLM's documented example) are taken as they
  are; they equal the card's prompt of the raw texts token for token.
"""

from __future__ import annotations

import msgspec
import pytest

from tests.pooling_cases import (
    VLLM_EXAMPLE_DOCUMENTS,
    VLLM_EXAMPLE_INSTRUCTION,
    VLLM_EXAMPLE_QUERIES,
    vllm_formatted_pairs,
)
from tests.test_pooling_routes import MAX_LEN, app_for, error_of, pair_tokens, tokenizer
from tp_engine.features.pooling.rerank_prompt import carries_template, rerank_token_ids

__all__ = ["tokenizer"]  # the module fixture, shared

MESSAGES = [
    {"role": "system", "content": "Represent the user's question."},
    {"role": "user", "content": "what is a cache"},
]


def template_ids(tokenizer, messages, **kw) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_messages_are_the_chat_templates_text_pooled(tokenizer):
    client, engine = app_for(tokenizer, ["embed", "score"])
    r = client.post("/v1/embeddings", json={"messages": MESSAGES})
    assert r.status_code == 200, r.json()
    want = template_ids(tokenizer, MESSAGES, add_generation_prompt=False)
    assert engine.sent[-1] == (want, {"task": "embed", "dimensions": None})
    # The same text sent as `input` (special tokens off) is the same prompt and vector.
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    same = client.post("/v1/embeddings", json={"input": text, "add_special_tokens": False})
    assert engine.sent[-1][0] == want
    assert same.json()["data"] == r.json()["data"]
    assert r.json()["usage"]["prompt_tokens"] == len(want)
    # The template's own inputs, as in a chat request.
    client.post("/v1/embeddings", json={"messages": MESSAGES, "add_generation_prompt": True})
    assert engine.sent[-1][0] == template_ids(tokenizer, MESSAGES, add_generation_prompt=True)
    assert engine.sent[-1][0] != want
    client.post("/pooling", json={"messages": MESSAGES})
    assert engine.sent[-1][0] == want


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": MESSAGES, "input": "a"}, "input"),
        ({}, "input"),
        ({"messages": []}, "messages"),
        ({"messages": MESSAGES, "chat_template": "{{ 'x' }}"}, "chat_template"),
        (
            {"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True},
            "continue_final_message",
        ),
        ({"messages": [{"role": "user", "content": "word " * MAX_LEN}]}, "messages"),
    ],
)
def test_wrong_chat_embeddings_are_400s(tokenizer, body, param):
    client, engine = app_for(tokenizer, ["embed"])
    status, got_param, message = error_of(client.post("/v1/embeddings", json=body))
    assert (status, got_param) == (400, param), message
    assert engine.sent == []


def test_documents_as_objects_and_max_tokens_per_doc(tokenizer):
    client, engine = app_for(tokenizer, ["classify", "score"])
    long_doc = "the quick brown fox jumps over the lazy dog " * 20
    short_doc = "a cache"
    body = {"query": "q", "documents": [{"text": short_doc}, long_doc]}
    # Without a cut the long document does not fit max_model_len.
    assert error_of(client.post("/rerank", json=body))[:2] == (400, "documents")
    r = client.post("/v2/rerank", json={**body, "max_tokens_per_doc": 5})
    assert r.status_code == 200, r.json()
    first5 = tokenizer.decode(tokenizer.encode(long_doc, add_special_tokens=False)[:5])
    assert len(tokenizer.encode(first5, add_special_tokens=False)) == 5
    sent = [ids for ids, _ in engine.sent[-2:]]
    assert sent == [
        pair_tokens(tokenizer, "q", short_doc, None),  # short enough: unchanged
        pair_tokens(tokenizer, "q", first5, None),
    ]
    # The answer shows each document as sent, not as cut.
    by_index = {res["index"]: res["document"]["text"] for res in r.json()["results"]}
    assert by_index == {0: short_doc, 1: long_doc}
    # A document far past what max_model_len could hold (refused unless cut) is cut too,
    # without the tokenizer reading all of it.
    huge = "the quick brown fox " * 20_000
    r = client.post("/rerank", json={"query": "q", "documents": [huge], "max_tokens_per_doc": 5})
    assert r.status_code == 200, r.json()
    assert engine.sent[-1][0] == pair_tokens(tokenizer, "q", first5, None)
    assert error_of(client.post("/rerank", json={"query": "q", "documents": [huge]}))[0] == 400
    for bad in (0, -3):
        status, param, _ = error_of(
            client.post("/rerank", json={**body, "max_tokens_per_doc": bad})
        )
        assert (status, param) == (400, "max_tokens_per_doc")
    status, param, _ = error_of(client.post("/rerank", json={"query": "q", "documents": [{}]}))
    assert status == 400


def test_vllm_formatted_texts_equal_the_cards_prompt(tokenizer):
    queries, docs = vllm_formatted_pairs(VLLM_EXAMPLE_QUERIES, VLLM_EXAMPLE_DOCUMENTS)
    for raw_q, raw_d, q, d in zip(
        VLLM_EXAMPLE_QUERIES, VLLM_EXAMPLE_DOCUMENTS, queries, docs, strict=True
    ):
        assert carries_template(q, d) and not carries_template(raw_q, raw_d)
        card = rerank_token_ids(tokenizer, raw_q, raw_d, VLLM_EXAMPLE_INSTRUCTION)
        assert rerank_token_ids(tokenizer, q, d) == card
        # Wrapped a second time (issue 43's bug), the prompt was another one.
        assert tokenizer.encode(q + d, add_special_tokens=False) == card
    with pytest.raises(ValueError, match="already carry"):
        rerank_token_ids(tokenizer, queries[0], docs[0], "another instruction")


def test_vllm_formatted_texts_on_the_routes(tokenizer):
    """The real pair builder behind the routes: vLLM's texts reach rank 0 as the card's prompt;
    an instruction beside them is a 400 naming it."""
    from starlette.testclient import TestClient

    from tests.test_pooling_routes import ScriptedEngine, hello
    from tp_engine.server.api.app import build_app

    # The card's prompt is ~280 tokens of this test vocabulary: a longer context.
    engine = ScriptedEngine(
        msgspec.structs.replace(hello("/m", ["classify", "score"]), max_model_len=1024)
    )
    client = TestClient(
        build_app(engine, tokenizer, pair_tokens=rerank_token_ids), base_url="http://localhost"
    )
    queries, docs = vllm_formatted_pairs(VLLM_EXAMPLE_QUERIES, VLLM_EXAMPLE_DOCUMENTS)
    cards = [
        rerank_token_ids(tokenizer, q, d, VLLM_EXAMPLE_INSTRUCTION)
        for q, d in zip(VLLM_EXAMPLE_QUERIES, VLLM_EXAMPLE_DOCUMENTS, strict=True)
    ]
    r = client.post("/score", json={"queries": queries, "documents": docs})
    assert r.status_code == 200, r.json()
    assert [ids for ids, _ in engine.sent] == cards
    engine.sent.clear()
    r = client.post("/rerank", json={"query": queries[0], "documents": docs[:1]})
    assert r.status_code == 200 and [ids for ids, _ in engine.sent] == cards[:1]
    body = {"query": queries[0], "documents": docs, "instruction": "x"}
    assert error_of(client.post("/rerank", json=body))[:2] == (400, "instruction")
