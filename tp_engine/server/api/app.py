"""The API process: FastAPI + uvicorn, started by rank 0 as `python -m tp_engine.server.api.app`.

It holds no engine state: it tokenizes, sends requests to rank 0, detokenizes what comes back
and applies stop strings, so that HTTP and text work never take the engine loop's interpreter
lock. Start-up: connect to rank 0's two sockets (`--run-dir`), wait for Hello (the engine is
loaded), load the tokenizer, bind the HTTP socket, then say Ready with the port. It exits when
rank 0 sends Exit (with rank 0's exit code), or at once if rank 0 disappears.

Routes (vLLM's): /v1/completions, /v1/chat/completions (a generate model), the pooling routes
of `pooling_routes` (a pooling model), /v1/models, /health, /version, /tokenize, /detokenize,
/tokenizer_info, /metrics; with LoRA, a request's `model` may name an adapter (`models`), and
with `VLLM_ALLOW_RUNTIME_LORA_UPDATING` /v1/load_lora_adapter and /v1/unload_lora_adapter
(`lora_routes`); SGLang's native /generate, /abort_request, /v1/loads (`sglang_routes`).
`guards.RequestGuard` checks the Host header,
the API key (every route that reads or costs), the body's type and size before a handler runs;
the handlers hand their CPU work to `request_work` so that the event loop only moves bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from shm_ipc.liveness import ProcessWatch
from tp_engine.features.pooling.rerank_prompt import rerank_token_ids
from tp_engine.server import request_trace
from tp_engine.server.api.admin_routes import build_admin_router
from tp_engine.server.api.chat_parsers import ChatParsing
from tp_engine.server.api.engine_client import EngineClient
from tp_engine.server.api.guards import RequestGuard, RequestLimits
from tp_engine.server.api.http_errors import APIError, install_handlers
from tp_engine.server.api.lora_routes import build_lora_router, runtime_lora_updating
from tp_engine.server.api.metrics import ServerMetrics
from tp_engine.server.api.models import ServedModels
from tp_engine.server.api.pooling_inputs import PairTokens, PoolingInputs
from tp_engine.server.api.pooling_routes import PoolingServing, build_pooling_router
from tp_engine.server.api.prompts import PromptBuilder
from tp_engine.server.api.protocol import (
    DetokenizeRequest,
    TokenizeRequest,
    parse_body,
)
from tp_engine.server.api.request_work import RequestWork
from tp_engine.server.api.serving import OpenAIServing
from tp_engine.server.api.sglang_routes import build_sglang_router
from tp_engine.server.api.tokenizer_load import load_tokenizer
from tp_engine.server.api.worker_routes import build_router
from tp_engine.server.ipc import ApiPipes
from tp_engine.server.messages import Exit, Hello, Ready

logger = logging.getLogger("tp_engine.server.api")

# Seconds uvicorn waits for open connections once told to exit (every stream has its last event
# by then: rank 0 sends Exit only after every request has finished or been aborted).
_GRACEFUL_EXIT_S = 5


def version() -> str:
    try:
        return metadata.version("tp-engine")
    except metadata.PackageNotFoundError:
        return "unknown"


def build_app(
    client: EngineClient,
    tokenizer: Any,
    on_startup: Callable[[], Awaitable[None]] | None = None,
    parsing: ChatParsing | None = None,
    pair_tokens: PairTokens | None = rerank_token_ids,
) -> FastAPI:
    """The app; `on_startup` runs as a task once the event loop is up (Ready is sent there);
    `parsing`: the chat-output parsers resolved against `tokenizer` (none by default);
    `pair_tokens`: a reranker's prompt of a (query, document) pair (cross-encoder scoring)."""
    hello = client.hello
    limits = RequestLimits.from_wire(hello.limits) if hello.limits else RequestLimits()
    builder = PromptBuilder(tokenizer, hello, parsing)
    work = RequestWork(limits)
    models = ServedModels(hello)
    serving = OpenAIServing(client, builder, work, models)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client.start()
        announce = asyncio.create_task(on_startup()) if on_startup is not None else None
        yield
        if announce is not None:
            announce.cancel()
        await client.stop()
        work.shutdown()

    app = FastAPI(title="tp-engine", version=version(), lifespan=lifespan)
    install_handlers(app)

    app.add_middleware(RequestGuard, limits=limits, api_key=hello.api_key)
    generates = "generate" in hello.supported_tasks
    inputs = PoolingInputs(builder, hello.pooled_size, hello.is_matryoshka, pair_tokens)
    pooling = PoolingServing(
        client, serving, work, inputs, hello.supported_tasks, hello.class_labels
    )
    probe = None if generates else pooling.probe
    app.include_router(build_router(client, serving, probe))  # what sglang-router probes
    if hello.enable_weight_updates or hello.enable_sleep_mode:
        app.include_router(
            build_admin_router(
                client,
                weight_updates=hello.enable_weight_updates,
                sleep_mode=hello.enable_sleep_mode,
            )
        )
    if hello.enable_lora and runtime_lora_updating():
        app.include_router(build_lora_router(client, models))

    @app.get("/health")
    async def health() -> Response:
        if client.dead is not None:
            return APIError(
                503, f"the engine is dead: {client.dead}", code="engine_dead"
            ).response()
        if client.draining:
            return APIError(503, "the server is shutting down").response()
        return Response(status_code=200)

    @app.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": version()}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": models.cards()}

    if generates:  # a pooling model has no completions (vLLM: 404)
        tensor_updates = hello.enable_weight_updates and hello.enable_weight_updates_from_tensor
        app.include_router(build_sglang_router(client, serving, tensor_updates=tensor_updates))

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            if client.trace is not None:
                request_trace.route_started()
            return await serving.completion_body(await request.body(), request)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            if client.trace is not None:
                request_trace.route_started()
            return await serving.chat_body(await request.body(), request)

    app.include_router(build_pooling_router(pooling))

    def tokenize_body(body: bytes) -> dict[str, Any]:
        req = parse_body(TokenizeRequest, body)
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            text = builder.render_chat(
                req.messages,
                add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                continue_final_message=req.continue_final_message,
                kwargs=req.chat_template_kwargs,
                tools=req.tools,
                documents=req.documents,
            )
            builder.check_text_length(text, "messages")
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            builder.check_text_length(req.prompt, "prompt")
            ids = tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
        return {"count": len(ids), "max_model_len": hello.max_model_len, "tokens": list(ids)}

    def detokenize_body(body: bytes) -> dict[str, Any]:
        req = parse_body(DetokenizeRequest, body)
        serving.check_model(req.model)
        ids = builder.check_token_ids(req.tokens, "tokens") if req.tokens else []
        return {"prompt": tokenizer.decode(ids)}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        return await work.run(tokenize_body, await request.body())

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        return await work.run(detokenize_body, await request.body())

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return builder.tokenizer_info()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(client.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


# -- the process -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="tp-engine API process (started by rank 0)")
    p.add_argument("--run-dir", required=True, help="rank 0's private socket directory")
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--uvicorn-log-level", default="info")
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    return p.parse_args(argv)


def _wait_for_hello(pipes: ApiPipes, parent: ProcessWatch) -> Hello | None:
    """Block until rank 0 has loaded the engine (minutes for a big model); None if it died or
    sent Exit instead."""
    while True:
        msg = pipes.recv(timeout_s=0.5)
        if isinstance(msg, Hello):
            return msg
        if isinstance(msg, Exit) or (msg is None and not parent.alive()):
            return None


@dataclass
class ApiServer:
    """The API process once it is ready to serve: its app bound to its socket."""

    client: EngineClient
    app: FastAPI
    server: Any  # uvicorn.Server
    sock: socket.socket

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]


def start_up(args: argparse.Namespace) -> ApiServer | None:
    """Everything the API process does before it serves: connect to rank 0, wait for Hello, load
    the tokenizer, build the app and bind its socket (a taken port ends the process here, with
    uvicorn's message). None when rank 0 went away or sent what this process cannot serve."""
    import uvicorn

    parent = ProcessWatch(args.parent_pid)
    pipes = ApiPipes(args.run_dir)
    hello = _wait_for_hello(pipes, parent)
    if hello is None:
        return None
    tokenizer = load_tokenizer(hello.tokenizer_dir or hello.model_dir)
    if hello.chat_template is not None:  # --chat-template replaces the checkpoint's
        tokenizer.chat_template = hello.chat_template
    try:
        parsing = ChatParsing.resolve(
            tokenizer, hello.reasoning_parser, hello.tool_call_parser, hello.enable_auto_tool_choice
        )
    except ValueError as exc:
        logger.error("cannot serve %s: %s", hello.model_dir, exc)
        return None
    client = EngineClient(
        pipes, hello, ServerMetrics(hello.served_model_names[0]), args.run_dir, args.parent_pid
    )
    ready: ApiServer | None = None

    async def announce() -> None:
        while ready is None or not ready.server.started:
            await asyncio.sleep(0.02)
        pipes.send(Ready(port=ready.port))

    app = build_app(client, tokenizer, announce, parsing)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_graceful_shutdown=_GRACEFUL_EXIT_S,
    )
    server = uvicorn.Server(config)
    ready = ApiServer(client, app, server, config.bind_socket())

    def on_exit(code: int) -> None:
        server.should_exit = True

    client.on_exit = on_exit
    return ready


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ready = start_up(args)
    if ready is None:
        return 1
    ready.server.run(sockets=[ready.sock])
    client = ready.client
    return client.exit_code if client.exit_code is not None else 1


if __name__ == "__main__":
    sys.exit(main())
