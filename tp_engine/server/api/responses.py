"""Response bodies as OpenAI shapes them, and the plumbing that ties a response to its client.

Bodies are plain dicts (cheaper than pydantic for one chunk per token, and their shape is
visible right here). Streams are server-sent events: `data: {json}\\n\\n` per chunk, ending
with `data: [DONE]\\n\\n`.

A client that goes away must stop its engine requests at once, whether or not a token is being
written at that moment: `CancellableStream` and `until_disconnect` listen for the ASGI
`http.disconnect` message beside the work and cancel the work when it comes; the work's
`finally` then aborts its requests on rank 0.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_DONE = b"data: [DONE]\n\n"
T = TypeVar("T")


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def completion_choice(
    index: int, text: str, finish_reason: str | None, stop_reason: int | str | None
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,  # vLLM's extra: the stop string or token id that matched
    }


def chat_choice(
    index: int,
    content: str | None,
    finish_reason: str | None,
    stop_reason: int | str | None,
    reasoning: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    message = {
        "role": "assistant",
        "content": content,
        "refusal": None,
        "tool_calls": tool_calls or [],
        # The thinking (with --reasoning-parser) under both of vLLM's names: clients read either.
        "reasoning_content": reasoning,
        "reasoning": reasoning,
    }
    return {
        "index": index,
        "message": message,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def reasoning_delta(text: str) -> dict[str, Any]:
    return {"reasoning_content": text, "reasoning": text}


def chat_chunk_choice(
    index: int, delta: dict[str, Any], finish_reason: str | None, stop_reason: int | str | None
) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return choice


def envelope(
    object_: str, request_id: str, created: int, model: str, choices: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": object_,
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": choices,
    }


class CancellableStream(StreamingResponse):
    """A StreamingResponse that stops generating (and closes its iterator, running its
    `finally`) the moment the client disconnects, not at the next write.

    `on_close` runs last whatever happened: closing an async generator that never started does
    not run its `finally`, so a client gone before the first chunk would otherwise leave its
    request running on rank 0.
    """

    def __init__(self, *args: Any, on_close: Callable[[], None] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        stream = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, watcher):
                task.cancel()
            # A send to a closed connection raises OSError in the stream task: the same
            # disconnect, already handled by closing the iterator below.
            await asyncio.gather(stream, watcher, return_exceptions=True)
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            finally:
                if self._on_close is not None:
                    self._on_close()


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it if the client disconnects first (raises ClientGone)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler itself was cancelled (server shutdown)
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone()
