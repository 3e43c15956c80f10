"""/v1/completions and /v1/chat/completions: validate, generate, shape OpenAI's responses.

Both run the same way: parse the body and check the request, build prompts and parameters
(`prompts.py`, on the request pool: see `request_work`; any problem is a 400 before rank 0 sees
the request), start a `Generation` (rank 0 may still refuse: a 400 or 503 for this request
only), then either collect every choice into one response or stream chunks as tokens arrive
(`streaming.py`). A request without an output constraint or tools (almost all) takes one trip to
the request pool for all of it, since each thread hop costs more than parsing a short body; one
with a constraint goes there, then to the constraints pool (within its time limit), then back
for its prompts. The checked `SamplingParams` are built once, in the pool, and sent as they are.

The pool's last trip also builds the `Generation` and sends its AddRequest (`_sent`), so the
request reaches rank 0 one thread switch after the loop handed the body over, not two; the loop
then waits for the verdict. Should the handler be cancelled meanwhile, what the thread sent is
aborted when it hands the Generation back (`RequestWork.run`'s `orphaned`). SGLang's /generate
parses and checks its body in one pool trip (`sglang_routes`), then builds its `Generation` on
the loop (`completion_generation` without `send`), which sends it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tp_engine.common.thinking import ThinkingState
from tp_engine.features.structured.grammar import StructuredOutputsParams
from tp_engine.lora_request import LoRARequest
from tp_engine.sampling_params import SamplingParams
from tp_engine.server.api.chat_output import ChatOutputParser
from tp_engine.server.api.constraints import gives_constraint, output_constraint
from tp_engine.server.api.disagg_fields import bootstrap_of
from tp_engine.server.api.engine_client import EngineClient
from tp_engine.server.api.generation import (
    EngineDiedError,
    Generation,
    PromptInput,
    RequestFailedError,
)
from tp_engine.server.api.http_errors import APIError
from tp_engine.server.api.logprob_format import LogprobFormatter
from tp_engine.server.api.models import ServedModels
from tp_engine.server.api.prompts import (
    PromptBuilder,
    check_choices,
    check_max_tokens,
    refuse_unsupported,
)
from tp_engine.server.api.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from tp_engine.server.api.request_work import RequestWork
from tp_engine.server.api.responses import (
    CancellableStream,
    ClientGone,
    chat_choice,
    completion_choice,
    envelope,
    new_request_id,
    now_s,
    until_disconnect,
)
from tp_engine.server.api.streaming import SSEStream
from tp_engine.server.api.tool_calls import ToolPlan, tool_plan
from tp_engine.server.messages import Bootstrap

logger = logging.getLogger(__name__)

# A client that has gone away never reads this status; it only shows in the access log.
_CLIENT_CLOSED = 499

# What the request pool made of a request: the adapter its `model` picks, the output
# constraint's parses for rank 0, and its prompt(s) with the checked SamplingParams; None there
# while an output constraint (or tools) is still to be checked on the constraints pool.
_Prepared = tuple[LoRARequest | None, dict[str, dict[str, Any]], tuple[Any, SamplingParams] | None]
# A chat request as the pool sent it: its Generation and its choices' output parsers.
_SentChat = tuple[Generation, Callable[[], ChatOutputParser]]


def _sent(gen: Generation) -> Generation:
    """(request pool) `gen`, its AddRequests sent."""
    gen.send()
    return gen


def _close_sent(result: object) -> None:
    """What the pool made for a handler cancelled meanwhile: the Generation it sent (alone or
    in tuples) is aborted on rank 0."""
    if isinstance(result, Generation):
        result.close()
    elif isinstance(result, tuple):
        for part in result:
            _close_sent(part)


class OpenAIServing:
    def __init__(
        self, client: EngineClient, builder: PromptBuilder, work: RequestWork, models: ServedModels
    ) -> None:
        self.client = client
        self.builder = builder
        self.work = work
        self.models = models
        self.model_name = client.hello.served_model_names[0]

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` picks (None: the base model); vLLM's 404 for a name that
        is neither."""
        return self.models.resolve(model)

    # -- completions -------------------------------------------------------------------------------

    async def completion_body(self, body: bytes, request: Request) -> Response:
        """/v1/completions: the body parsed, checked and (without an output constraint) turned
        into prompts and sent to rank 0 in one trip to the request pool (`_parsed_completion`):
        never on the event loop, however small the body."""
        headers = request.headers
        req, prepared, gen = await self.work.run(
            self._parsed_completion, body, headers, orphaned=_close_sent
        )
        if gen is None:  # an output constraint to check first
            gen = await self.completion_generation(
                req, headers=headers, prepared=prepared, send=True
            )
        return await self._respond(gen, req, request, chat=False)

    async def completion(self, req: CompletionRequest, request: Request) -> Response:
        gen = await self.completion_generation(req, headers=request.headers)
        return await self._respond(gen, req, request, chat=False)

    async def completion_generation(
        self,
        req: CompletionRequest,
        request_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        prepared: _Prepared | None = None,
        send: bool = False,
    ) -> Generation:
        """A checked completion request, ready to start (SGLang's /generate runs these too);
        `headers`: the HTTP request's (a router's bootstrap overrides); `prepared`: what
        `_checked_completion` already made of it; `send`: the pool's last trip sends it too
        (`_sent`), as an OpenAI route's does."""
        if prepared is None:  # its checks, never on the event loop
            prepared = await self.work.run(self._checked_completion, req)
        adapter, checks, inputs = prepared
        if inputs is None:  # an output constraint: checked on its own pool, in its time limit
            limits = self.work.limits
            constraint = await self.work.constraint(output_constraint, req, None, limits, checks)
            if send:
                return await self.work.run(
                    self._completion_sent, req, constraint, headers, adapter, checks,
                    orphaned=_close_sent,
                )  # fmt: skip
            inputs = await self.work.run(self._completion_inputs, req, constraint)
        return self._completion(req, inputs, request_id, headers, adapter, checks)

    def _completion(
        self,
        req: CompletionRequest,
        inputs: tuple[list[PromptInput], SamplingParams],
        request_id: str | None,
        headers: Mapping[str, str] | None,
        adapter: LoRARequest | None,
        checks: dict[str, dict[str, Any]],
    ) -> Generation:
        prompts, params = inputs
        return self._generation(
            "cmpl",
            req,
            prompts,
            lambda p: params,
            adapter,
            request_id,
            checks,
            bootstrap_of(req, headers, len(prompts)),
        )

    def _parsed_completion(
        self, body: bytes, headers: Mapping[str, str]
    ) -> tuple[CompletionRequest, _Prepared, Generation | None]:
        """(request pool) The body, validated, then `_checked_completion`; without an output
        constraint, its Generation too, sent to rank 0 (None: the constraint is to check)."""
        req = parse_body(CompletionRequest, body)
        prepared = self._checked_completion(req)
        adapter, checks, inputs = prepared
        if inputs is None:
            return req, prepared, None
        return req, prepared, _sent(self._completion(req, inputs, None, headers, adapter, checks))

    def _completion_sent(
        self,
        req: CompletionRequest,
        constraint: StructuredOutputsParams | None,
        headers: Mapping[str, str] | None,
        adapter: LoRARequest | None,
        checks: dict[str, dict[str, Any]],
    ) -> Generation:
        """(request pool) A constrained completion's prompts, then its Generation, sent."""
        inputs = self._completion_inputs(req, constraint)
        return _sent(self._completion(req, inputs, None, headers, adapter, checks))

    def _checked_completion(self, req: CompletionRequest) -> _Prepared:
        """(request pool) The request's checks, in the order they answer; its prompts and
        parameters too unless it gives an output constraint (`gives_constraint`), which goes
        to the constraints pool first."""
        adapter = self.check_model(req.model)
        refuse_unsupported(req)
        check_max_tokens(req)
        checks: dict[str, dict[str, Any]] = {}  # parsed on rank 0 (`constraints`)
        if gives_constraint(req):
            return adapter, checks, None
        # Nothing to parse: the constraints pool's check, inline.
        constraint = output_constraint(req, None, self.work.limits, checks)
        return adapter, checks, self._completion_inputs(req, constraint)

    def _completion_inputs(
        self, req: CompletionRequest, constraint: StructuredOutputsParams | None
    ) -> tuple[list[PromptInput], SamplingParams]:
        """(request pool) Tokenized prompts and the checked SamplingParams, which every prompt
        sends (each as its own AddRequest fields)."""
        prompts = self.builder.completion_prompts(req)
        check_choices(len(prompts), req.n)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default
        extra = {"structured_outputs": constraint}
        # Validate once, before any length check.
        params = self.builder.sampling_params(req, max_tokens, extra)
        for prompt in prompts:
            self.builder.check_fits(len(prompt.token_ids), max_tokens, "prompt")
        return prompts, params

    # -- chat --------------------------------------------------------------------------------------

    async def chat_body(self, body: bytes, request: Request) -> Response:
        """/v1/chat/completions: parsed, checked and (without tools or an output constraint)
        rendered, tokenized and sent to rank 0 in one trip to the request pool."""
        headers = request.headers
        req, prepared, sent = await self.work.run(
            self._parsed_chat, body, headers, orphaned=_close_sent
        )
        if sent is None:  # tools or an output constraint: checked on their own pool
            adapter, checks, _ = prepared
            tools, constraint = await self.work.constraint(self._chat_constraint, req, checks)
            sent = await self.work.run(
                self._chat_sent, req, (constraint, tools), headers, adapter, checks,
                orphaned=_close_sent,
            )  # fmt: skip
        gen, output = sent
        return await self._respond(gen, req, request, chat=True, chat_output=output)

    def _parsed_chat(
        self, body: bytes, headers: Mapping[str, str]
    ) -> tuple[ChatCompletionRequest, _Prepared, _SentChat | None]:
        """(request pool) The body, validated, then `_checked_chat`; without tools or an
        output constraint, its Generation too, sent (None: they are to check)."""
        req = parse_body(ChatCompletionRequest, body)
        prepared = self._checked_chat(req)
        adapter, checks, inputs = prepared
        if inputs is None:
            return req, prepared, None
        return req, prepared, self._chat_generation(req, inputs, None, headers, adapter, checks)

    def _chat_sent(
        self,
        req: ChatCompletionRequest,
        checked: tuple[StructuredOutputsParams | None, ToolPlan | None],
        headers: Mapping[str, str],
        adapter: LoRARequest | None,
        checks: dict[str, dict[str, Any]],
    ) -> _SentChat:
        """(request pool) A chat request with tools or a constraint: its prompt, then its
        Generation, sent."""
        constraint, tools = checked
        inputs = self._chat_inputs(req, constraint)
        return self._chat_generation(req, inputs, tools, headers, adapter, checks)

    def _chat_generation(
        self,
        req: ChatCompletionRequest,
        inputs: tuple[PromptInput, SamplingParams],
        tools: ToolPlan | None,
        headers: Mapping[str, str],
        adapter: LoRARequest | None,
        checks: dict[str, dict[str, Any]],
    ) -> _SentChat:
        """(request pool) The Generation, sent, and the choices' output parsers."""
        prompt, params = inputs
        gen = self._generation(
            "chatcmpl",
            req,
            [prompt],
            lambda p: params,
            adapter,
            constraint_checks=checks,
            bootstrap=bootstrap_of(req, headers, 1),
        )
        output = self._chat_output(req, prompt, tools)  # first: nothing may fail once sent
        return _sent(gen), output

    def _checked_chat(self, req: ChatCompletionRequest) -> _Prepared:
        """(request pool) As `_checked_completion`: tools count as a constraint (their schemas
        are checked on the constraints pool)."""
        adapter = self.check_model(req.model)
        refuse_unsupported(req)
        check_max_tokens(req)
        check_choices(1, req.n)
        checks: dict[str, dict[str, Any]] = {}  # parsed on rank 0 (`constraints`)
        if gives_constraint(req):
            return adapter, checks, None
        # Nothing to parse: the constraints pool's check, inline.
        _, constraint = self._chat_constraint(req, checks)  # no tools (else it gives one)
        return adapter, checks, self._chat_inputs(req, constraint)

    def _chat_constraint(
        self, req: ChatCompletionRequest, checks: dict[str, dict[str, Any]]
    ) -> tuple[ToolPlan | None, StructuredOutputsParams | None]:
        """The checked tools and the output constraint (constraints pool); the parses for rank
        0 go into `checks`."""
        tools = tool_plan(req, self.builder.parsing, self.work.limits)
        return tools, output_constraint(req, tools, self.work.limits, checks)

    def _chat_inputs(
        self, req: ChatCompletionRequest, constraint: StructuredOutputsParams | None
    ) -> tuple[PromptInput, SamplingParams]:
        """(request pool) The rendered and tokenized prompt and the checked SamplingParams."""
        prompt = self.builder.chat_prompt(req)
        # With --reasoning-parser the constraint applies after the thinking.
        extra = {
            **self.builder.thinking_fields(req, prompt, constrained=constraint is not None),
            "structured_outputs": constraint,
        }
        requested = req.max_completion_tokens
        if requested is None:
            requested = req.max_tokens
        # Validate before any length check (1 stands in for "whatever room is left").
        params = self.builder.sampling_params(req, 1 if requested is None else requested, extra)
        self.builder.check_fits(len(prompt.token_ids), requested, "messages")
        if requested is None:
            max_tokens = self.builder.default_max_tokens(len(prompt.token_ids))
            params = self.builder.sampling_params(req, max_tokens, extra)
        return prompt, params

    def _chat_output(
        self, req: ChatCompletionRequest, prompt: PromptInput, tools: ToolPlan | None
    ) -> Callable[[], ChatOutputParser]:
        """A new output parser for each choice: reasoning by the prompt's thinking state,
        tool calls by the request's tools."""
        parsing, tokenizer = self.builder.parsing, self.builder.tokenizer
        state = ThinkingState.NOT_STARTED
        if parsing.think is not None:
            state = parsing.think.prompt_state(prompt.token_ids)
        return lambda: ChatOutputParser(
            tokenizer, parsing, tools, state, skip_special_tokens=req.skip_special_tokens
        )

    # -- shared ------------------------------------------------------------------------------------

    def _generation(
        self,
        prefix: str,
        req: Any,
        prompts: list[PromptInput],
        params_for,
        adapter: LoRARequest | None,
        request_id: str | None = None,
        constraint_checks: dict[str, dict[str, Any]] | None = None,
        bootstrap: list[Bootstrap | None] | None = None,
    ) -> Generation:
        return Generation(
            self.client,
            self.builder.tokenizer,
            request_id or new_request_id(prefix),
            prompts,
            params_for,
            req.n,
            self.builder.stop_options(req),
            adapter,
            constraint_checks,
            bootstrap,
        )

    async def _respond(
        self,
        gen: Generation,
        req: Any,
        request: Request,
        chat: bool,
        chat_output: Callable[[], ChatOutputParser] | None = None,
    ) -> Response:
        request_id = gen.request_id
        created = now_s()
        if req.stream:
            try:
                gen.send()  # now, not once the task below first runs
                await until_disconnect(request, gen.start())
            except ClientGone:
                gen.close()
                return Response(status_code=_CLIENT_CLOSED)
            except BaseException:
                gen.close()
                raise
            stream = SSEStream(
                gen,
                req,
                envelope_fields=(request_id, created, self._model_of(gen)),
                chat=chat,
                prompt_text=self._prompt_text,
                formatter=LogprobFormatter(self.builder.tokenizer),
                chat_output=chat_output,
            )
            return CancellableStream(
                stream.events(), media_type="text/event-stream", on_close=gen.close
            )
        try:
            body = await until_disconnect(
                request, self._collect(gen, req, request_id, created, chat_output)
            )
        except ClientGone:
            return Response(status_code=_CLIENT_CLOSED)
        except EngineDiedError as exc:
            raise APIError(500, f"the engine died: {exc}", code="engine_dead") from None
        except RequestFailedError as exc:
            raise APIError(500, str(exc), code="request_failed") from None
        finally:  # also when `_collect` was cancelled before it ran: the pool had sent it
            gen.close()
        return JSONResponse(body)

    async def _collect(
        self,
        gen: Generation,
        req: Any,
        request_id: str,
        created: int,
        chat_output: Callable[[], ChatOutputParser] | None,
    ) -> dict[str, Any]:
        try:
            await gen.start()
            async for _ in gen.updates():
                pass
        finally:
            gen.close()
        fmt = LogprobFormatter(self.builder.tokenizer)
        chat = chat_output is not None
        choices = []
        reasoning_tokens = 0
        for c in gen.choices:
            text = c.detok.text
            prompt = gen.prompts[c.prompt_index]
            if chat_output is not None:
                parser = chat_output()
                parser.feed(c.detok.token_ids, text, finished=True)
                reasoning_tokens += parser.reasoning_tokens
                choice = chat_choice(
                    c.index,
                    parser.message_content(),
                    parser.finish_reason(c.finish_reason),
                    c.stop_reason,
                    reasoning=(parser.reasoning or None) if parser.parses_reasoning else None,
                    tool_calls=[call.as_dict() for call in parser.tool_calls],
                )
                if req.logprobs:
                    choice["logprobs"] = fmt.chat(c.logprobs or [])
            else:
                if req.echo:
                    text = self._prompt_text(prompt) + text
                choice = completion_choice(c.index, text, c.finish_reason, c.stop_reason)
                if req.logprobs is not None:
                    echo = gen.echo_logprobs(c.prompt_index, req.logprobs) if req.echo else None
                    choice["logprobs"] = fmt.completion(c.logprobs or [], echo=echo)
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = fmt.prompt(
                        gen.prompt_logprobs[c.prompt_index] or []
                    )
            if req.return_token_ids:
                choice["prompt_token_ids"] = prompt.token_ids
                choice["token_ids"] = c.detok.token_ids
            choices.append(choice)
        obj = "chat.completion" if chat else "text_completion"
        body = envelope(obj, request_id, created, self._model_of(gen), choices)
        body["usage"] = gen.usage()
        if chat and self.builder.parsing.think is not None:
            body["usage"]["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        if chat and req.prompt_logprobs is not None:  # vLLM puts chat's at the top level
            body["prompt_logprobs"] = fmt.prompt(gen.prompt_logprobs[0] or [])
        return body

    def _model_of(self, gen: Generation) -> str:
        """The `model` a response carries: the adapter's name, else the base model's."""
        return self.model_name if gen.adapter is None else gen.adapter.lora_name

    def _prompt_text(self, prompt: PromptInput) -> str:
        """The prompt as text, for echo (a token-id prompt is decoded, as vLLM does)."""
        if prompt.text is None:
            prompt.text = self.builder.tokenizer.decode(prompt.token_ids)
        return prompt.text
