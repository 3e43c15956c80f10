"""Routes that change a running engine: RL weight sync, pause, sleep. Offered only when asked for.

`--enable-weight-updates` (SGLang's routes, and vLLM's pause and cache routes):

    POST /update_weights_from_disk        {"model_path", "weight_version"?, "flush_cache"?}
    POST /init_weights_update_group       {"master_address", "master_port", "rank_offset",
                                           "world_size", "group_name"?, "backend"?}
    POST /update_weights_from_distributed {"names", "dtypes", "shapes", "group_name"?,
                                           "weight_version"?, "flush_cache"?}
    POST /destroy_weights_update_group    {"group_name"?}
    POST /get_weights_by_name             {"name", "truncate_size"?}   → the values, a list
    GET  /get_weight_version                                           → {"weight_version"}
    POST /flush_cache, /reset_prefix_cache
    POST /pause_generation {"mode"?}, /continue_generation   (SGLang: abort | retract | in_place)
    POST /pause?mode=abort|wait|keep, /resume; GET /is_paused                  (vLLM)

`--enable-sleep-mode` (vLLM's and SGLang's):

    POST /sleep?level=1|2, /wake_up?tags=weights&tags=kv_cache; GET /is_sleeping
    POST /release_memory_occupation {"tags"?}, /resume_memory_occupation {"tags"?}

SGLang's routes answer `{"success": bool, "message": str}` (400 when refused); vLLM's answer
JSON or the OpenAI error shape. Every route is behind the API key when one is set (the guard
keys everything outside its open list), and each runs on rank 0 between two steps
(`control_ops`); a refusal leaves the engine unchanged and serving.

SGLang's pause modes map onto this engine's: "abort" is abort, "in_place" is keep, and
"retract" (SGLang frees the running requests' KV and recomputes it later) is keep too: the
requests continue after resume either way, this engine just keeps their blocks meanwhile.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from tp_engine.server.engine_client import EngineClient
from tp_engine.server.http_errors import APIError
from tp_engine.server.messages import ControlReply

_SGLANG_PAUSE_MODES = {"abort": "abort", "in_place": "keep", "retract": "keep"}
_GROUP = "weight_update_group"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UpdateFromDisk(_Body):
    model_path: str
    load_format: str | None = None  # SGLang's; only the checkpoint's own safetensors are read
    weight_version: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class InitGroup(_Body):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = _GROUP
    backend: str | None = None


class UpdateFromDistributed(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = _GROUP
    weight_version: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class DestroyGroup(_Body):
    group_name: str = _GROUP


class WeightsByName(_Body):
    name: str
    truncate_size: int = 100


class PauseGeneration(_Body):
    mode: str = "abort"


class MemoryTags(_Body):
    tags: list[str] | None = None


def _sglang(reply: ControlReply, done: str) -> JSONResponse:
    ok = reply.status == 200
    return JSONResponse(
        {"success": ok, "message": done if ok else reply.message},
        status_code=reply.status,
    )


def _vllm(reply: ControlReply) -> dict[str, Any]:
    if reply.status != 200:
        raise APIError(reply.status, reply.message)
    return reply.result


def build_admin_router(
    client: EngineClient, *, weight_updates: bool, sleep_mode: bool
) -> APIRouter:
    router = APIRouter()

    async def call(op: str, args: dict[str, Any] | None = None) -> ControlReply:
        return await client.control(op, args)

    async def pause_first(abort_all_requests: bool) -> ControlReply | None:
        """SGLang's `abort_all_requests`: abort what runs before the update (a refusal of the
        pause is the route's answer)."""
        if not abort_all_requests:
            return None
        reply = await call("pause", {"mode": "abort"})
        if reply.status != 200:
            return reply
        await call("resume")
        return None

    if weight_updates:

        @router.post("/update_weights_from_disk")
        async def update_weights_from_disk(body: UpdateFromDisk) -> JSONResponse:
            refused = await pause_first(body.abort_all_requests)
            args = body.model_dump(exclude={"load_format", "abort_all_requests"})
            reply = refused or await call("update_weights_from_disk", args)
            return _sglang(reply, f"weights updated from {body.model_path}")

        @router.post("/init_weights_update_group")
        async def init_weights_update_group(body: InitGroup) -> JSONResponse:
            reply = await call("init_weights_update_group", body.model_dump())
            return _sglang(reply, f"group {body.group_name!r} ready")

        @router.post("/update_weights_from_distributed")
        async def update_weights_from_distributed(body: UpdateFromDistributed) -> JSONResponse:
            refused = await pause_first(body.abort_all_requests)
            args = body.model_dump(exclude={"abort_all_requests"})
            reply = refused or await call("update_weights_from_distributed", args)
            return _sglang(reply, f"{len(body.names)} tensors updated")

        @router.post("/destroy_weights_update_group")
        async def destroy_weights_update_group(body: DestroyGroup) -> JSONResponse:
            reply = await call("destroy_weights_update_group", body.model_dump())
            return _sglang(reply, f"group {body.group_name!r} destroyed")

        @router.post("/get_weights_by_name")
        async def get_weights_by_name(body: WeightsByName) -> Any:
            return _vllm(await call("get_weights_by_name", body.model_dump()))["values"]

        @router.get("/get_weight_version")
        async def get_weight_version() -> dict[str, Any]:
            return _vllm(await call("get_weight_version"))

        @router.post("/flush_cache")
        async def flush_cache() -> JSONResponse:
            return _sglang(await call("reset_prefix_cache"), "Cache flushed.")

        @router.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> dict[str, Any]:
            return _vllm(await call("reset_prefix_cache"))

        @router.post("/pause_generation")
        async def pause_generation(body: PauseGeneration | None = None) -> JSONResponse:
            mode = (body or PauseGeneration()).mode
            if mode not in _SGLANG_PAUSE_MODES:
                modes = ", ".join(_SGLANG_PAUSE_MODES)
                reply = ControlReply(0, 400, f"unknown mode {mode!r}; expected one of {modes}", {})
            else:
                reply = await call("pause", {"mode": _SGLANG_PAUSE_MODES[mode]})
            return _sglang(reply, f"generation paused ({mode})")

        @router.post("/continue_generation")
        async def continue_generation() -> JSONResponse:
            return _sglang(await call("resume"), "generation continued")

        @router.post("/pause")
        async def pause(mode: str = "abort") -> dict[str, Any]:
            return _vllm(await call("pause", {"mode": mode}))

        @router.post("/resume")
        async def resume() -> dict[str, Any]:
            return _vllm(await call("resume"))

        @router.get("/is_paused")
        async def is_paused() -> dict[str, Any]:
            return _vllm(await call("is_paused"))

    if sleep_mode:

        @router.post("/sleep")
        async def sleep(level: int = 1) -> dict[str, Any]:
            return _vllm(await call("sleep", {"level": level}))

        @router.post("/wake_up")
        async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> dict[str, Any]:
            return _vllm(await call("wake_up", {"tags": tags}))

        @router.get("/is_sleeping")
        async def is_sleeping() -> dict[str, Any]:
            return _vllm(await call("is_sleeping"))

        @router.post("/release_memory_occupation")
        async def release_memory_occupation(body: MemoryTags | None = None) -> JSONResponse:
            tags = (body or MemoryTags()).tags
            if tags is not None and set(tags) != {"weights", "kv_cache"}:
                reply = ControlReply(
                    0, 400, f"tags {tags}: only both weights and kv_cache are released together", {}
                )
            else:
                reply = await call("sleep", {"level": 1})
            return _sglang(reply, "memory released")

        @router.post("/resume_memory_occupation")
        async def resume_memory_occupation(body: MemoryTags | None = None) -> JSONResponse:
            tags = (body or MemoryTags()).tags
            return _sglang(await call("wake_up", {"tags": tags}), "memory resumed")

    return router
