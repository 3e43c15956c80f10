"""The pooling routes: embeddings, classification, scores and reranking, vLLM's shapes.

Which routes exist follows the tasks the model supports (`Hello.supported_tasks`), as in vLLM:

    route                                   task      what rank 0 computes per prompt
    /v1/embeddings                          embed     the (normalised, maybe cut) embedding
                                                      of each input, or of the messages
                                                      through the chat template
    /pooling                                any       the model's own pooled output
    /classify                               classify  class probabilities
    /score, /rerank, /v1/rerank, /v2/rerank score     an embedding model: both texts'
                                                      embeddings (score = their cosine); a
                                                      cross-encoder: one prompt per pair,
                                                      its relevance in [0, 1]

A route of another task is not registered, so it answers the server's 404 for unknown routes.
Each handler parses and tokenizes on the request pool (`pooling_inputs`), sends the prompts as
one `PoolingBatch`, and shapes the answer on the request pool too (`pooling_responses`): the
event loop only moves bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response

from tp_engine.server.api.engine_client import EngineClient
from tp_engine.server.api.http_errors import APIError, bad_request
from tp_engine.server.api.pooling_batch import PoolingBatch
from tp_engine.server.api.pooling_inputs import (
    PoolingInputs,
    activation_fields,
    check_top_n,
    score_pairs,
)
from tp_engine.server.api.pooling_protocol import (
    ClassifyRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)
from tp_engine.server.api.pooling_responses import (
    classify_data,
    cosine,
    embedding_data,
    list_body,
    rerank_body,
    score_data,
)
from tp_engine.server.api.protocol import parse_body
from tp_engine.server.api.request_work import RequestWork
from tp_engine.server.api.responses import ClientGone, new_request_id, until_disconnect
from tp_engine.server.api.serving import OpenAIServing

POOLING_TASKS = frozenset(("embed", "classify", "score"))
# Answered to a client that went away (only the access log sees it), as `serving` does.
_CLIENT_CLOSED = 499


class PoolingServing:
    def __init__(
        self,
        client: EngineClient,
        serving: OpenAIServing,
        work: RequestWork,
        inputs: PoolingInputs,
        tasks: list[str],
        class_labels: list[str],
    ) -> None:
        self.client = client
        self.serving = serving
        self.work = work
        self.inputs = inputs
        self.tasks = frozenset(tasks)
        self.class_labels = class_labels
        self.model_name = serving.model_name

    @property
    def own_task(self) -> str:
        """What the model pools when a route names no task (/pooling, the health probe)."""
        return "embed" if "embed" in self.tasks else "classify"

    # -- routes ------------------------------------------------------------------------------------

    async def embeddings(self, request: Request) -> Response:
        return await self._embed_like(request, "embd", "embed", "embedding")

    async def pooling(self, request: Request) -> Response:
        return await self._embed_like(request, "pool", self.own_task, "pooling")

    async def classify(self, request: Request) -> Response:
        req = await self._parse(request, ClassifyRequest)
        keep_last = self.inputs.truncation(req.truncate_prompt_tokens)
        prompts = await self.work.run(
            self.inputs.prompts, req.input, req.add_special_tokens, keep_last
        )
        request_id = new_request_id("classify")
        params = {"task": "classify", **activation_fields(req)}
        probs = await self._pooled(request, request_id, prompts, params)
        return await self._answer(
            lambda: list_body(
                request_id,
                self.model_name,
                classify_data(probs, self.class_labels),
                _num_tokens(prompts),
            )
        )

    async def score(self, request: Request) -> Response:
        req = await self._parse(request, ScoreRequest)
        queries, documents = score_pairs(req)
        request_id = new_request_id("score")
        scores, num_tokens = await self._scores(
            request,
            request_id,
            queries,
            documents,
            req.instruction,
            req.truncate_prompt_tokens,
            activation_fields(req),
        )
        return await self._answer(
            lambda: list_body(request_id, self.model_name, score_data(scores), num_tokens)
        )

    async def rerank(self, request: Request) -> Response:
        req = await self._parse(request, RerankRequest)
        top_n = check_top_n(req.top_n)
        if not req.query:
            raise APIError(400, "query must not be empty", param="query")
        originals = [d if isinstance(d, str) else d.text for d in req.documents]
        scored = await self.work.run(
            self.inputs.rerank_documents, req.documents, req.max_tokens_per_doc
        )
        request_id = new_request_id("rerank")
        queries = [req.query] * len(scored)
        scores, num_tokens = await self._scores(
            request,
            request_id,
            queries,
            scored,
            req.instruction,
            req.truncate_prompt_tokens,
            activation_fields(req),
        )
        return await self._answer(
            lambda: rerank_body(
                request_id,
                self.model_name,
                originals,
                scores,
                top_n,
                req.return_documents,
                num_tokens,
            )
        )

    async def probe(self, request: Request) -> bool:
        """SGLang's deep health check (`/health_generate`) for a model that cannot generate:
        one token pooled through the whole engine."""
        try:
            await self._pooled(request, new_request_id("health"), [[0]], {"task": self.own_task})
        except APIError:
            return False
        return True

    # -- shared ------------------------------------------------------------------------------------

    async def _embed_like(
        self, request: Request, prefix: str, task: str, object_name: str
    ) -> Response:
        req = await self._parse(request, EmbeddingRequest)
        params = self.inputs.embed_fields(req.dimensions, req.encoding_format, req.normalize)
        params["task"] = task
        keep_last = self.inputs.truncation(req.truncate_prompt_tokens)
        prompts = await self.work.run(self.inputs.embedding_prompts, req, keep_last)
        request_id = new_request_id(prefix)
        vectors = await self._pooled(request, request_id, prompts, params)

        def body() -> dict[str, Any]:
            data = embedding_data(vectors, req.encoding_format, object_name)
            return list_body(request_id, self.model_name, data, _num_tokens(prompts))

        return await self._answer(body)

    async def _scores(
        self,
        request: Request,
        request_id: str,
        queries: list[str],
        documents: list[str],
        instruction: str | None,
        truncate_prompt_tokens: int | None,
        activation: dict[str, Any],
    ) -> tuple[list[float], int]:
        """The score of each (query, document) pair and the prompt tokens it took. `activation`
        is a cross-encoder's (`activation_fields`); an embedding model's cosine has none."""
        keep_last = self.inputs.truncation(truncate_prompt_tokens)
        if "embed" in self.tasks:
            # Each distinct text embedded once (a query repeated for every document is one).
            texts = list(dict.fromkeys([*queries, *documents]))
            prompts = await self.work.run(self.inputs.text_prompts, texts, keep_last)
            vectors = await self._pooled(request, request_id, prompts, {"task": "embed"})
            by_text = dict(zip(texts, vectors, strict=True))
            scores = [
                cosine(by_text[q], by_text[d]) for q, d in zip(queries, documents, strict=True)
            ]
        else:
            prompts = await self.work.run(
                self.inputs.pair_prompts, queries, documents, instruction, keep_last
            )
            params = {"task": "score", **activation}
            vectors = await self._pooled(request, request_id, prompts, params)
            scores = [float(v[0]) for v in vectors]
        return scores, _num_tokens(prompts)

    async def _parse(self, request: Request, model: type) -> Any:
        req = await self.work.run(parse_body, model, await request.body())
        if self.serving.check_model(req.model) is not None:
            # Pooled on the base model, the answer would be passed off as the adapter's.
            raise bad_request(
                f"LoRA adapters serve generation only; {req.model!r} cannot pool (name the "
                "base model)",
                "model",
            )
        return req

    async def _pooled(
        self, request: Request, request_id: str, prompts: list[list[int]], params: dict[str, Any]
    ) -> list[np.ndarray]:
        """Every prompt pooled by rank 0; the client leaving aborts them (a 499 then)."""
        batch = PoolingBatch(self.client, request_id, prompts, params)
        try:
            return await until_disconnect(request, batch.run())
        except ClientGone:
            raise _Gone() from None
        finally:
            batch.close()

    async def _answer(self, build: Callable[[], dict[str, Any]]) -> Response:
        """`build()` as a JSON response, built and encoded on the request pool (thousands of
        floats are not the event loop's work)."""
        body = await self.work.run(lambda: json.dumps(build(), separators=(",", ":")))
        return Response(body, media_type="application/json")


class _Gone(APIError):
    """The client disconnected; nobody reads the answer."""

    def __init__(self) -> None:
        super().__init__(_CLIENT_CLOSED, "the client disconnected")


def _num_tokens(prompts: list[list[int]]) -> int:
    return sum(len(p) for p in prompts)


def build_pooling_router(serving: PoolingServing) -> APIRouter:
    """The routes of the tasks the model supports; none for a generate model."""
    router = APIRouter()
    tasks = serving.tasks

    def post(path: str, handler: Any) -> None:
        router.add_api_route(path, handler, methods=["POST"])

    if tasks & POOLING_TASKS:
        post("/pooling", serving.pooling)
    if "embed" in tasks:
        post("/v1/embeddings", serving.embeddings)
    if "classify" in tasks:
        post("/classify", serving.classify)
    if "score" in tasks:
        for path in ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"):
            post(path, serving.score if path.endswith("score") else serving.rerank)
    return router
