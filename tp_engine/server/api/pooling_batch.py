"""One HTTP request's prompts pooled by rank 0, in the API process.

A request with P prompts becomes P engine requests (ids `<request id>-<prompt index>`), each
with the same `PoolingParams` fields. Unlike a `Generation` nothing streams: each engine request
answers with one Delta that carries its pooled vector. Its life:

    run(): Add each → collect every verdict and pooled vector → float32 arrays in prompt order
           (a rejection, an abort or the engine's death is an APIError for the whole request)
    close(): in a `finally`: aborts whatever has not answered (the client went away)
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from tp_engine.server.api.engine_client import ACCEPTED, EngineClient, EngineDied
from tp_engine.server.api.http_errors import APIError
from tp_engine.server.api.metrics import RequestTimes
from tp_engine.server.messages import Delta, Rejected

# Little-endian float32: the byte order of `Delta.pooled`, whatever the machines' order.
POOLED_DTYPE = np.dtype("<f4")


class PoolingBatch:
    def __init__(
        self,
        client: EngineClient,
        request_id: str,
        prompts: list[list[int]],
        pooling_params: dict[str, Any],
    ) -> None:
        self.client = client
        self.request_id = request_id
        self.prompts = prompts
        self.pooling_params = pooling_params
        self.arrival = time.monotonic()
        self.engine_ids = [f"{request_id}-{p}" for p in range(len(prompts))]
        self._index = {engine_id: p for p, engine_id in enumerate(self.engine_ids)}
        self._pooled: list[np.ndarray | None] = [None] * len(prompts)
        self._queue: asyncio.Queue = asyncio.Queue()

    async def run(self) -> list[np.ndarray]:
        """Each prompt's pooled vector, in prompt order; raises APIError if rank 0 refused
        any prompt (every other one is aborted), aborted one, or died."""
        client = self.client
        if client.dead is not None:
            raise APIError(503, f"the engine is dead: {client.dead}", code="engine_dead")
        if client.draining:
            raise APIError(503, "the server is shutting down; retry elsewhere")
        for engine_id, prompt in zip(self.engine_ids, self.prompts, strict=True):
            client.add(self._queue, engine_id, prompt, {}, pooling_params=self.pooling_params)
        while any(v is None for v in self._pooled):
            engine_id, event = await self._queue.get()
            self._apply(engine_id, event)
        return [v for v in self._pooled if v is not None]

    def _apply(self, engine_id: str, event: Any) -> None:
        if isinstance(event, EngineDied):
            raise APIError(503, f"the engine is dead: {event.message}", code="engine_dead")
        if isinstance(event, Rejected):
            raise APIError(event.status, event.message)
        if event == ACCEPTED or not isinstance(event, Delta):
            return
        if event.pooled is None:  # ended without a result: shutdown, pause or sleep
            raise APIError(503, f"the request ended before it was pooled ({event.finish_reason})")
        index = self._index[engine_id]
        self._pooled[index] = np.frombuffer(event.pooled, dtype=POOLED_DTYPE)
        self.client.release(engine_id)
        self._record(len(self.prompts[index]), event)

    def _record(self, num_prompt_tokens: int, delta: Delta) -> None:
        """/metrics counts a pooled prompt as a request that generated nothing."""
        metrics = self.client.metrics
        metrics.prompt_tokens.inc(num_prompt_tokens)
        metrics.request_finished(
            delta.finish_reason or "stop",
            num_prompt_tokens=num_prompt_tokens,
            num_generated_tokens=0,
            e2e_s=time.monotonic() - self.arrival,
            queue_time_s=delta.queue_time_s,
            times=RequestTimes(scheduled_at=delta.scheduled_at),
        )
        metrics.samples_finished([0])

    def close(self) -> None:
        """Abort every prompt that has no result yet. Synchronous: safe in a cancelled
        `finally`."""
        for engine_id, pooled in zip(self.engine_ids, self._pooled, strict=True):
            if pooled is None:
                self.client.abort(engine_id)
