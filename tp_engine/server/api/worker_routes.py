"""What a router asks of a worker: the routes sglang-router probes, in the form it reads them.

sglang-router (`python -m sglang_router.launch_router --worker-urls ...`, or
`launch/serve.py --data-parallel-size N`, which starts one in front of N replicas) registers a
worker in three probes: `/health` (the API server's own), `/server_info` and `/model_info`
(falling back to `/get_server_info` and `/get_model_info` on a 404). From them it takes the model
id that requests and its `/v1/models` are matched against (`served_model_name`), the tokenizer
it loads for its own tokenizer-aware features (`tokenizer_path`, `model_path`: the local
checkpoint directory, which it reads without downloading anything) and labels it reports per
worker (`model_type`, `architectures`, `tp_size`, `dp_size`). Without these routes it registers
the model as "unknown" and warns on every worker.

Also answered: `/get_load` (what its power-of-two policy and load monitor read: one entry per
data-parallel rank of this server, which is one) and `/health_generate` (SGLang's deep health
check: a one-token generation through the whole engine, or one pooled token for a pooling
model, so a wedged engine fails it while `/health` may still pass).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tp_engine.server.api.engine_client import EngineClient
from tp_engine.server.api.http_errors import APIError
from tp_engine.server.api.protocol import CompletionRequest
from tp_engine.server.api.serving import OpenAIServing
from tp_engine.server.messages import Hello

logger = logging.getLogger("tp_engine.server.api")


def checkpoint_facts(model_dir: str) -> dict[str, Any]:
    """`model_type` and `architectures` from the checkpoint's config.json (empty when it cannot
    be read: the router then only lacks these labels)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        logger.warning("cannot read %s/config.json for /model_info: %s", model_dir, exc)
        return {}
    return {k: config[k] for k in ("model_type", "architectures") if k in config}


def server_info(hello: Hello) -> dict[str, Any]:
    """SGLang's /server_info fields that a router reads (model id, path, parallel sizes)."""
    return {
        "model_path": hello.model_dir,
        "tokenizer_path": hello.model_dir,
        "served_model_name": hello.served_model_names[0],
        "tp_size": hello.tensor_parallel_size,
        # One engine per server: data parallelism is N servers behind the router, not inside one.
        "dp_size": 1,
        "max_model_len": hello.max_model_len,
        "context_length": hello.max_model_len,
        # SGLang's name for sleep mode; slime checks it against its --offload-rollout.
        "enable_memory_saver": hello.enable_sleep_mode,
        # --disaggregation-mode: "null", "prefill" or "decode" (the router lists it).
        "disaggregation_mode": hello.disaggregation_mode,
    }


def model_info(hello: Hello, facts: dict[str, Any]) -> dict[str, Any]:
    """SGLang's /model_info: what the router registers the model under."""
    return {
        "model_path": hello.model_dir,
        "tokenizer_path": hello.model_dir,
        "served_model_name": hello.served_model_names[0],
        # False for a pooling model: a router must not send it completions.
        "is_generation": "generate" in hello.supported_tasks,
        "max_model_len": hello.max_model_len,
        **facts,
    }


def build_router(
    client: EngineClient,
    serving: OpenAIServing,
    pooling_probe: Callable[[Request], Awaitable[bool]] | None = None,
) -> APIRouter:
    """`pooling_probe`: the deep health check of a model that cannot generate (it pools one
    token instead)."""
    hello = client.hello
    facts = checkpoint_facts(hello.model_dir)
    router = APIRouter()

    @router.get("/server_info")
    @router.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        return server_info(hello)

    @router.get("/model_info")
    @router.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return model_info(hello, facts)

    @router.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        stats = client.metrics.last_engine_stats
        running = stats.num_running if stats is not None else 0
        waiting = stats.num_waiting if stats is not None else 0
        return [
            {
                "dp_rank": 0,
                "num_reqs": running + waiting,
                "num_waiting_reqs": waiting,
                # Requests, not tokens: the API process does not know the pool's size. Its
                # only use is comparing workers of one model, for which a count is as good.
                "num_tokens": running + waiting,
            }
        ]

    @router.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        if client.dead is not None:
            return APIError(
                503, f"the engine is dead: {client.dead}", code="engine_dead"
            ).response()
        if pooling_probe is not None:
            return Response(status_code=200 if await pooling_probe(request) else 503)
        probe = CompletionRequest(prompt=[0], max_tokens=1, temperature=0.0)
        response = await serving.completion(probe, request)
        return Response(status_code=200 if response.status_code == 200 else 503)

    return router
