"""SGLang's native routes, which RL rollout clients (slime, AReaL, agent frameworks) call:
`/generate`, `/abort_request`, `/v1/loads`; `/update_weights_from_tensor` (slime's colocated
weight sync, whose body is pickled tensor handles) only with `--enable-weight-updates` and
`--enable-weight-updates-from-tensor`, read on rank 0 by `tp_engine.features.weights_and_sleep.tensor_payload`'s
restricted unpickler.

`/generate` runs exactly what `/v1/completions` runs (the same prompt building, validation,
sampling parameters and `Generation`), so greedy tokens and logprobs are equal on the same
request; only the names and the response's shape are SGLang's:

    request                                  as /v1/completions
    ───────────────────────────────────────  ─────────────────────────────────────────────
    text | input_ids (one, or a batch)       prompt
    sampling_params.max_new_tokens (128)     max_tokens
      temperature, top_p, top_k (-1: off),   the same names
      min_p, stop, stop_token_ids,
      ignore_eos, skip_special_tokens, n,
      presence/frequency/repetition_penalty
      min_new_tokens, no_stop_trim,          min_tokens, include_stop_str_in_output,
      sampling_seed                          seed
      custom_params,                         (no effect, as in SGLang without a custom
      spaces_between_special_tokens          logit processor and with a fast tokenizer)
    return_logprob                           logprobs=0
    rid (one, or one per prompt)             the request ids /abort_request names
    stream                                   stream (each event carries the text so far,
                                             as SGLang's do, then `data: [DONE]`)

SGLang's other request fields (sglang-router adds them all when it re-serializes a body) are
accepted as SGLang accepts them, ignored where they change nothing here and refused by name
where they ask for a feature this server lacks (`sglang_fields`).

Each output: `{"text", "output_ids", "meta_info": {"id", "finish_reason": {"type": "stop" |
"length" | "abort", "matched"?: token id or stop string, "length"?}, "prompt_tokens",
"completion_tokens", "cached_tokens", "weight_version", "output_token_logprobs"?: [[logprob,
token_id, null], ...]}}`; a batch (or n > 1) answers a list. A refusal is a 400 with
`{"error": {"message"}}` (SGLang's shape; ours adds OpenAI's fields).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tp_engine.server.api.engine_client import EngineClient
from tp_engine.server.api.generation import Generation, RequestFailedError
from tp_engine.server.api.http_errors import APIError
from tp_engine.server.api.protocol import CompletionRequest
from tp_engine.server.api.responses import ClientGone, until_disconnect
from tp_engine.server.api.serving import OpenAIServing
from tp_engine.server.api.sglang_fields import refused_extra
from tp_engine.server.messages import Delta

# SGLang's sampling_params names -> /v1/completions' (the same meaning).
_RENAMED = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "no_stop_trim": "include_stop_str_in_output",
}
_SAME = ("temperature", "top_p", "min_p", "stop", "stop_token_ids", "ignore_eos",
         "skip_special_tokens", "n", "presence_penalty", "frequency_penalty",
         "repetition_penalty", "seed")  # fmt: skip
_MAX_NEW_TOKENS = 128  # SGLang's default
# Accepted and without effect here, as in SGLang in the same case: `custom_params` goes to a
# custom logit processor (none is loaded), and `spaces_between_special_tokens` changes nothing
# with a fast tokenizer (Qwen3's). slime sends both.
_NO_EFFECT = ("custom_params", "spaces_between_special_tokens")


class GenerateRequest(BaseModel):
    # SGLang's other fields arrive too (sglang-router re-serializes every body with them):
    # kept aside and judged by `sglang_fields.refused_extra`.
    model_config = ConfigDict(extra="allow")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    return_logprob: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    # SGLang's, accepted with their default meaning only.
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False


class UpdateFromTensor(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # SGLang's: one payload per TP rank of the sender's engine; each holds the full tensors
    # (handles to the same memory), so rank 0 reads the first and broadcasts to the others.
    serialized_named_tensors: list[str] = Field(min_length=1)
    load_format: str | None = None  # None (pairs) or "flattened_bucket" (slime's)
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class AbortRequest(BaseModel):
    rid: str = ""
    abort_all: bool = False


def _completion_request(req: GenerateRequest) -> tuple[CompletionRequest, int]:
    """The same request as /v1/completions takes it, and how many prompts it has."""
    if (req.text is None) == (req.input_ids is None):
        raise APIError(400, "Either text or input_ids should be provided.", param="text")
    prompt: Any = req.text if req.text is not None else req.input_ids
    batch = isinstance(prompt, list) and (not prompt or not isinstance(prompt[0], int))
    num_prompts = len(prompt) if batch else 1
    if req.top_logprobs_num or req.logprob_start_len not in (-1, 0):
        raise APIError(400, "top_logprobs_num and logprob_start_len are not supported")
    sp = dict(req.sampling_params)
    fields: dict[str, Any] = {"prompt": prompt, "max_tokens": _MAX_NEW_TOKENS}
    for name in _NO_EFFECT:
        sp.pop(name, None)
    if "sampling_seed" in sp:
        fields["seed"] = sp.pop("sampling_seed")
    for name in list(sp):
        if name in _RENAMED:
            fields[_RENAMED[name]] = sp.pop(name)
        elif name in _SAME:
            fields[name] = sp.pop(name)
    top_k = sp.pop("top_k", None)
    if top_k is not None and top_k != -1:
        fields["top_k"] = top_k
    if sp:
        raise APIError(400, f"unsupported sampling_params: {sorted(sp)}", param="sampling_params")
    if req.return_logprob:
        fields["logprobs"] = 0
    for name in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):  # a PD router's
        if (req.model_extra or {}).get(name) is not None:
            fields[name] = req.model_extra[name]  # type: ignore[index]
    try:
        return CompletionRequest.model_validate(fields), num_prompts
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(400, f"sampling_params.{where}: {first.get('msg')}") from None


def _parsed_generate(
    serving: OpenAIServing, body: bytes
) -> tuple[GenerateRequest, CompletionRequest, int, Any]:
    """(request pool) The body, validated and its fields refused as SGLang's refuses them, as
    the completion request it runs (`_completion_request`), with that request's checks
    (`OpenAIServing._checked_completion`); APIError (400) naming what is wrong."""
    try:
        req = GenerateRequest.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(400, f"{where}: {first.get('msg')}", param=where) from None
    refused = refused_extra(req.model_extra or {})
    if refused is not None:
        raise APIError(400, refused, param=refused.split()[0].rstrip(":"))
    creq, num_prompts = _completion_request(req)
    return req, creq, num_prompts, serving._checked_completion(creq)


def _request_ids(req: GenerateRequest, num_prompts: int) -> list[str] | None:
    """Each prompt's `rid`. A batch is one request here, whose id is its first rid; /abort_request
    with any of its rids aborts all of it."""
    if req.rid is None:
        return None
    rids = [req.rid] if isinstance(req.rid, str) else list(req.rid)
    if len(rids) != num_prompts or len(set(rids)) != len(rids):
        raise APIError(400, f"rid needs {num_prompts} distinct ids, got {rids!r:.200}", param="rid")
    return rids


def _finish(choice: Any) -> dict[str, Any] | None:
    reason = choice.finish_reason
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": len(choice.detok.token_ids)}
    if reason == "stop":
        return {"type": "stop", "matched": choice.stop_reason}
    return {"type": "abort", "message": str(reason)}


def _output(
    gen: Generation, choice: Any, rids: list[str] | None, version: str, logprobs: bool
) -> dict:
    prompt = gen.prompts[choice.prompt_index]
    meta: dict[str, Any] = {
        "id": rids[choice.prompt_index] if rids else gen.request_id,
        "finish_reason": _finish(choice),
        "prompt_tokens": len(prompt.token_ids),
        "completion_tokens": len(choice.detok.token_ids),
        "cached_tokens": choice.num_cached_tokens,
        "weight_version": version,
    }
    if logprobs:
        meta["output_token_logprobs"] = [
            [e.logprobs[0], e.token_ids[0], None] for e in choice.logprobs or []
        ]
    return {
        "text": choice.detok.text,
        "output_ids": list(choice.detok.token_ids),
        "meta_info": meta,
    }


class _Running:
    """The /generate requests in flight, by their request id (SGLang's `rid`), so that
    /abort_request can end them: the engine drops an aborted sample without a word, so the
    abort's last Delta ("abort", no tokens) is handed to the request here."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.by_id: dict[str, Generation] = {}

    def add(self, names: list[str], gen: Generation) -> None:
        for name in names:
            self.by_id[name] = gen

    def forget(self, names: list[str]) -> None:
        for name in names:
            self.by_id.pop(name, None)

    def abort(self, request_id: str | None) -> int:
        """Abort one request (None: every one); how many."""
        if request_id is None:
            gens = list({id(g): g for g in self.by_id.values()}.values())
        else:
            gens = [self.by_id.get(request_id)]
        count = 0
        for gen in gens:
            if gen is None:
                continue
            for c in gen.choices:
                if c.finished:
                    continue
                engine_id = gen.engine_ids[c.prompt_index]
                self.client.abort(engine_id, [c.sample_index])
                last = Delta(engine_id, c.sample_index, [], "abort", None, None, None, None, None)
                gen.deliver(engine_id, last)
            count += 1
        return count


def build_sglang_router(
    client: EngineClient, serving: OpenAIServing, *, tensor_updates: bool = False
) -> APIRouter:
    router = APIRouter()
    running = _Running(client)

    async def weight_version() -> str:
        reply = await client.control("get_weight_version")
        return str(reply.result.get("weight_version", "default"))

    @router.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        body = await request.body()
        req, creq, num_prompts, prepared = await serving.work.run(_parsed_generate, serving, body)
        rids = _request_ids(req, num_prompts)
        busy = [r for r in rids or [] if r in running.by_id]
        if busy:
            raise APIError(400, f"a request with rid {busy[0]!r} is running", param="rid")
        gen = await serving.completion_generation(
            creq, rids[0] if rids else None, headers=request.headers, prepared=prepared
        )
        names = rids or [gen.request_id]
        single = num_prompts == 1 and creq.n == 1
        running.add(names, gen)
        try:
            await until_disconnect(request, gen.start())
        except BaseException:
            running.forget(names)
            gen.close()
            raise
        if req.stream:
            events = _events(gen, req, rids, names, single)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            await until_disconnect(request, _drain(gen, names))
        except ClientGone:
            return Response(status_code=499)
        except RequestFailedError as exc:
            raise APIError(500, str(exc), code="request_failed") from None
        version = await weight_version()
        outs = [_output(gen, c, rids, version, req.return_logprob) for c in gen.choices]
        return JSONResponse(outs[0] if single else outs)

    async def _drain(gen: Generation, names: list[str]) -> None:
        try:
            async for _ in gen.updates():
                pass
        finally:
            running.forget(names)
            gen.close()

    async def _events(
        gen: Generation, req: GenerateRequest, rids: list[str] | None, names: list[str],
        single: bool,
    ) -> AsyncIterator[bytes]:  # fmt: skip
        try:
            async for update in gen.updates():
                c = update.choice
                version = await weight_version() if c.finished else ""
                out = _output(gen, c, rids, version, req.return_logprob)
                if not single:
                    out["index"] = c.index
                yield b"data: " + json.dumps(out).encode() + b"\n\n"
        except RequestFailedError as exc:
            error = {"error": {"message": str(exc), "code": "request_failed"}}
            yield b"data: " + json.dumps(error).encode() + b"\n\n"
        finally:
            running.forget(names)
            gen.close()
        yield b"data: [DONE]\n\n"

    @router.post("/abort_request")
    async def abort_request(body: AbortRequest) -> Response:
        """SGLang's: end the /generate request `rid` (every one with `abort_all`), its outputs
        so far answered with finish_reason abort."""
        running.abort(None if body.abort_all else body.rid)
        return Response(status_code=200)

    @router.get("/v1/loads")
    async def loads() -> dict[str, Any]:
        stats = client.metrics.last_engine_stats
        running_reqs = stats.num_running if stats is not None else 0
        waiting = stats.num_waiting if stats is not None else 0
        return {
            "timestamp": time.time(),
            "loads": [{"dp_rank": 0, "num_running_reqs": running_reqs,
                       "num_waiting_reqs": waiting, "num_total_reqs": running_reqs + waiting}],
        }  # fmt: skip

    if tensor_updates:

        @router.post("/update_weights_from_tensor")
        async def update_weights_from_tensor(body: UpdateFromTensor) -> JSONResponse:
            if body.abort_all_requests:
                running.abort(None)
            args = {"payload": body.serialized_named_tensors[0], "load_format": body.load_format,
                    "flush_cache": body.flush_cache, "weight_version": body.weight_version}  # fmt: skip
            reply = await client.control("update_weights_from_tensor", args)
            ok = reply.status == 200
            message = "weights updated from tensors" if ok else reply.message
            return JSONResponse({"success": ok, "message": message}, status_code=reply.status)

    return router
