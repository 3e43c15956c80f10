"""Routes that change a running engine: RL weight sync, pause, sleep. Offered only when asked for.

`--enable-weight-updates` (SGLang's routes, and vLLM's pause and cache routes). Methods as
SGLang takes them: where SGLang takes GET and POST, so does this server, and a GET's fields may
come as query parameters.

    POST /update_weights_from_disk        {"model_path", "load_format"?, "weight_version"?,
                                           "flush_cache"?, "abort_all_requests"?}
    POST /init_weights_update_group       {"master_address", "master_port", "rank_offset",
                                           "world_size", "group_name"?, "backend"?, "timeout"?}
    POST /update_weights_from_distributed {"names", "dtypes", "shapes", "group_name"?,
                                           "load_format"?, "weight_version"?, "flush_cache"?}
    POST /destroy_weights_update_group    {"group_name"?}
    GET|POST /get_weights_by_name         {"name", "truncate_size"?}   → the values, a list
    GET  /get_weight_version                                           → {"weight_version"}
    GET|POST /flush_cache; POST /reset_prefix_cache → {"num_dropped_blocks", "fully_reset"}
    POST /pause_generation {"mode"?}, /continue_generation   (SGLang: abort | retract | in_place)
    GET|POST /pause?mode=abort|wait|keep, /resume; GET /is_paused      (vLLM's, which is POST)

`--enable-sleep-mode` (vLLM's and SGLang's):

    POST /sleep?level=1|2, /wake_up?tags=weights&tags=kv_cache; GET /is_sleeping
    GET|POST /release_memory_occupation {"tags"?}, /resume_memory_occupation {"tags"?}
        (SGLang's tags: weights, kv_cache, cuda_graph; this engine's CUDA graphs follow the
        other two, so "cuda_graph" alone changes nothing)

SGLang's routes answer `{"success": bool, "message": str}` (400 when refused), its pause routes
`{"message", "status": "ok"}`; vLLM's answer JSON or the OpenAI error shape. Every route is
behind the API key when one is set (the guard keys everything outside its open list), and each
runs on rank 0 between two steps (`control_ops`); a refusal leaves the engine unchanged and
serving. `flagged_routes` names the flag behind each route, for the 404 of a server without it.

Joining a trainer's group waits for the trainer (`rank_worker.control.weight_group`): the ranks join in
the background and this route polls them between steps, so the engine serves meanwhile; a group
that has not formed within `timeout` seconds (SGLang's request has no such field; default
`rank_worker.control.weight_group.DEFAULT_JOIN_TIMEOUT_S`, which rank 0 names in its reply) is abandoned on every rank and answered 400 with the reason.

SGLang's pause modes map onto this engine's: "abort" is abort, "in_place" is keep, and
"retract" (SGLang frees the running requests' KV and recomputes it later) is keep too: the
requests continue after resume either way, this engine just keeps their blocks meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from tp_engine.features.weights_and_sleep.group_join import (
    JOIN_GRACE_S,
    JOIN_POLL_S,
    join_timed_out,
)
from tp_engine.server.api.engine_client import EngineClient
from tp_engine.server.api.http_errors import APIError
from tp_engine.server.messages import ControlReply

_SGLANG_PAUSE_MODES = {"abort": "abort", "in_place": "keep", "retract": "keep"}
_GROUP = "weight_update_group"
_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's GPU_MEMORY_TYPE_*


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
    timeout: float | None = None  # seconds the join may wait; None: the ranks' default


class UpdateFromDistributed(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = _GROUP
    load_format: str | None = None  # SGLang's (slime sends it); the tensors are HF-named
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


async def _fields(request: Request, model: type[_Body]) -> Any:
    """The body (JSON) of a POST, or of a GET that has one, else a GET's query parameters, as
    `model` (SGLang's GET routes read a body; curl users send query parameters)."""
    raw = await request.body()
    try:
        if raw.strip():
            return model.model_validate_json(raw)
        return model.model_validate(dict(request.query_params))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise APIError(400, f"{where}: {first.get('msg')}", param=where) from None


def _sglang(reply: ControlReply, done: str) -> JSONResponse:
    ok = reply.status == 200
    return JSONResponse(
        {"success": ok, "message": done if ok else reply.message},
        status_code=reply.status,
    )


def _refusal(message: str) -> ControlReply:
    return ControlReply(0, 400, message, {})


def _vllm(reply: ControlReply) -> dict[str, Any]:
    if reply.status != 200:
        raise APIError(reply.status, reply.message)
    return reply.result


def _memory_tags(tags: list[str] | None) -> list[str] | None:
    """SGLang's tags as this engine's (None: all); ValueError for an unknown tag."""
    if tags is None:
        return None
    unknown = [t for t in tags if t not in _MEMORY_TAGS]
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}; expected some of {list(_MEMORY_TAGS)}")
    return [t for t in tags if t != "cuda_graph"]


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

    async def join_group(body: InitGroup) -> ControlReply:
        """Start the ranks' joins, then poll them between steps until every rank joined, one
        failed, or the timeout (then every rank abandons the group)."""
        args = body.model_dump(exclude={"timeout"})
        args["timeout_s"] = body.timeout
        reply = await call("start_weights_update_group", args)
        if reply.status != 200:
            return reply
        limit = float(reply.result["timeout_s"])  # rank 0's: the ranks' default when None
        deadline = time.monotonic() + limit + JOIN_GRACE_S
        name = {"group_name": body.group_name}
        while True:
            reply = await call("weights_update_group_state", name)
            if reply.status != 200 or reply.result.get("state") == "joined":
                return reply
            if time.monotonic() > deadline:
                await call("abandon_weights_update_group", name)
                pending = reply.result.get("pending_ranks", [])
                return _refusal(join_timed_out(body.group_name, limit, pending))
            await asyncio.sleep(JOIN_POLL_S)

    if weight_updates:

        @router.post("/update_weights_from_disk")
        async def update_weights_from_disk(body: UpdateFromDisk) -> JSONResponse:
            refused = await pause_first(body.abort_all_requests)
            args = body.model_dump(exclude={"load_format", "abort_all_requests"})
            reply = refused or await call("update_weights_from_disk", args)
            return _sglang(reply, f"weights updated from {body.model_path}")

        @router.post("/init_weights_update_group")
        async def init_weights_update_group(body: InitGroup) -> JSONResponse:
            return _sglang(await join_group(body), f"group {body.group_name!r} ready")

        @router.post("/update_weights_from_distributed")
        async def update_weights_from_distributed(body: UpdateFromDistributed) -> JSONResponse:
            refused = await pause_first(body.abort_all_requests)
            args = body.model_dump(exclude={"abort_all_requests", "load_format"})
            reply = refused or await call("update_weights_from_distributed", args)
            return _sglang(reply, f"{len(body.names)} tensors updated")

        @router.post("/destroy_weights_update_group")
        async def destroy_weights_update_group(body: DestroyGroup) -> JSONResponse:
            reply = await call("destroy_weights_update_group", body.model_dump())
            return _sglang(reply, f"group {body.group_name!r} destroyed")

        @router.api_route("/get_weights_by_name", methods=["GET", "POST"])
        async def get_weights_by_name(request: Request) -> Any:
            body = await _fields(request, WeightsByName)
            return _vllm(await call("get_weights_by_name", body.model_dump()))["values"]

        @router.get("/get_weight_version")
        async def get_weight_version() -> dict[str, Any]:
            return _vllm(await call("get_weight_version"))

        @router.api_route("/flush_cache", methods=["GET", "POST"])
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
                reply = _refusal(f"unknown mode {mode!r}; expected one of {modes}")
            else:
                reply = await call("pause", {"mode": _SGLANG_PAUSE_MODES[mode]})
            if reply.status != 200:
                return _sglang(reply, "")
            return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

        @router.post("/continue_generation")
        async def continue_generation() -> JSONResponse:
            reply = await call("resume")
            if reply.status != 200:
                return _sglang(reply, "")
            return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

        @router.api_route("/pause", methods=["GET", "POST"])
        async def pause(mode: str = "abort") -> dict[str, Any]:
            return _vllm(await call("pause", {"mode": mode}))

        @router.api_route("/resume", methods=["GET", "POST"])
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

        @router.api_route("/release_memory_occupation", methods=["GET", "POST"])
        async def release_memory_occupation(request: Request) -> JSONResponse:
            try:
                tags = _memory_tags((await _fields(request, MemoryTags)).tags)
            except ValueError as exc:
                return _sglang(_refusal(str(exc)), "")
            if tags is not None and set(tags) != {"weights", "kv_cache"}:
                reply = _refusal(
                    f"tags {tags}: only both weights and kv_cache are released together"
                )
            else:
                reply = await call("sleep", {"level": 1})
            return _sglang(reply, "memory released")

        @router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
        async def resume_memory_occupation(request: Request) -> JSONResponse:
            try:
                tags = _memory_tags((await _fields(request, MemoryTags)).tags)
            except ValueError as exc:
                return _sglang(_refusal(str(exc)), "")
            if tags == []:  # only "cuda_graph": they come back with the kv cache
                return _sglang(ControlReply(0, 200, "", {}), "memory resumed")
            return _sglang(await call("wake_up", {"tags": tags}), "memory resumed")

    return router
