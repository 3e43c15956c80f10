"""vLLM's runtime adapter routes, offered only when `VLLM_ALLOW_RUNTIME_LORA_UPDATING` is true
(404 otherwise, as in vLLM):

    POST /v1/load_lora_adapter   {"lora_name", "lora_path"}  → 200 text "Success: LoRA adapter
                                 '<name>' added successfully."
    POST /v1/unload_lora_adapter {"lora_name"}               → 200 text "Success: LoRA adapter
                                 '<name>' removed successfully."

A load is checked on rank 0 and, where a device slot can be had, loaded on every rank before
the name is served (`LLMEngine.add_lora`); an unload makes the name unknown at once (known
again if rank 0 fails it), and rank 0 lets the requests already using the adapter finish
before it gives the slot back. A lock per
name makes a load and an unload of one name one after the other. Refusals carry vLLM's
messages; the engine serves on.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import defaultdict

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from tp_engine.server.api.engine_client import EngineClient
from tp_engine.server.api.http_errors import APIError
from tp_engine.server.api.models import ServedModels

logger = logging.getLogger(__name__)

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating() -> bool:
    """vLLM's switch (its env parser: "1" or "true", any case)."""
    return os.environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str | None = None
    lora_path: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str | None = None
    lora_int_id: int | None = None


def _invalid(message: str) -> APIError:
    return APIError(400, message, type="InvalidUserInput", code=400)


def _refused(status: int, message: str) -> APIError:
    kind = "NotFoundError" if status == 404 else "BadRequestError"
    return APIError(status, message, type=kind, code=status)


def build_lora_router(client: EngineClient, models: ServedModels) -> APIRouter:
    router = APIRouter()
    locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
    logger.warning(
        "LoRA dynamic loading & unloading is enabled in the API server. This should ONLY be "
        "used for local development!"
    )

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        name, path = body.lora_name, body.lora_path
        if not name or not path:
            raise _invalid("Both 'lora_name' and 'lora_path' must be provided.")
        async with locks[name]:
            if name in models.adapters:
                raise _invalid(f"The lora adapter '{name}' has already been loaded.")
            adapter = models.new_adapter(name, path)
            args = {"lora_name": name, "lora_int_id": adapter.lora_int_id, "lora_path": path}
            reply = await client.control("load_lora_adapter", args)
            if reply.status != 200:
                raise _refused(reply.status, reply.message)
            models.adapters[name] = adapter
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        name = body.lora_name
        if not name:
            raise _invalid("'lora_name' needs to be provided to unload a LoRA adapter.")
        async with locks[name]:
            adapter = models.adapters.pop(name, None)
            if adapter is None:
                raise _refused(404, f"The lora adapter '{name}' cannot be found.")
            reply = await client.control(
                "unload_lora_adapter", {"lora_int_id": adapter.lora_int_id}
            )
            if reply.status != 200:
                if reply.status != 404:  # rank 0 still serves it (a 404: it had it no more)
                    models.adapters[name] = adapter
                raise _refused(reply.status, reply.message)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return router
