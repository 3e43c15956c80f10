"""The server-sent events of one streamed completion or chat completion, as OpenAI sends them.

    chat:        per choice a first chunk with delta {"role": "assistant", "content": ""}, then
                 content deltas, then a chunk with an empty delta and its finish_reason. With
                 the output parsers (`chat_output`): reasoning deltas ({"reasoning_content",
                 "reasoning"}) while the model thinks, content deltas, and tool-call deltas
                 ({"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}
                 first, then {"tool_calls": [{"index", "function": {"arguments"}}]} fragments),
                 one kind per chunk, in the order the output has them
    completions: text chunks; the last one of a choice carries its finish_reason; with echo,
                 a choice's first chunk starts with the prompt (and its logprobs)
    both:        with stream_options.include_usage every chunk has "usage": null (or running
                 totals with vLLM's continuous_usage_stats) and a last chunk with empty choices
                 carries the usage; `data: [DONE]` ends the stream

If the engine dies mid-stream, an error event in OpenAI's envelope precedes `[DONE]`. Closing
the iterator (the client went away) aborts every unfinished choice on rank 0.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from tp_engine.server.api.chat_output import ChatOutputParser
from tp_engine.server.api.generation import (
    ChoiceUpdate,
    EngineDiedError,
    Generation,
    PromptInput,
    RequestFailedError,
)
from tp_engine.server.api.http_errors import error_body
from tp_engine.server.api.logprob_format import LogprobFormatter
from tp_engine.server.api.responses import (
    SSE_DONE,
    chat_chunk_choice,
    completion_choice,
    envelope,
    reasoning_delta,
    sse,
)


class SSEStream:
    def __init__(
        self,
        gen: Generation,
        req: Any,
        *,
        envelope_fields: tuple[str, int, str],
        chat: bool,
        prompt_text: Callable[[PromptInput], str],
        formatter: LogprobFormatter,
        chat_output: Callable[[], ChatOutputParser] | None = None,
    ) -> None:
        """`chat_output` (chat only) makes each choice's output parser."""
        self.gen = gen
        self.req = req
        self.chat = chat
        self._prompt_text = prompt_text
        self._fmt = formatter
        self._object = "chat.completion.chunk" if chat else "text_completion"
        self._request_id, self._created, self._model = envelope_fields
        options = req.stream_options
        self._include_usage = bool(options and options.include_usage)
        self._continuous_usage = bool(options and options.continuous_usage_stats)
        self._started: set[int] = set()
        self._text_offsets: dict[int, int] = {}  # completions logprobs: text so far, per choice
        # Chat: each choice's output parser (reasoning, content, tool calls).
        self._parsers: dict[int, ChatOutputParser] = {}
        self._chat_output = chat_output

    def _chunk(self, choices: list[dict[str, Any]]) -> bytes:
        body = envelope(self._object, self._request_id, self._created, self._model, choices)
        if self._include_usage:
            body["usage"] = self.gen.usage() if self._continuous_usage else None
        return sse(body)

    async def events(self) -> AsyncIterator[bytes]:
        gen = self.gen
        try:
            if self.chat:
                for c in gen.choices:
                    role = {"role": "assistant", "content": ""}
                    yield self._chunk([chat_chunk_choice(c.index, role, None, None)])
            trace = gen.client.trace
            async for update in gen.updates():
                if trace is not None:
                    trace.mark_once("api_chunk", gen.engine_ids[0])
                for chunk in self._chunks(update):
                    yield chunk
            if self._include_usage:
                body = envelope(self._object, self._request_id, self._created, self._model, [])
                body["usage"] = self._usage()
                yield sse(body)
        except EngineDiedError as exc:
            yield sse(error_body(f"the engine died: {exc}", "server_error", None, "engine_dead"))
        except RequestFailedError as exc:
            yield sse(error_body(str(exc), "server_error", None, "request_failed"))
        finally:
            gen.close()
        yield SSE_DONE

    def _usage(self) -> dict[str, Any]:
        usage = self.gen.usage()
        parsers = list(self._parsers.values())
        if parsers and parsers[0].parses_reasoning:
            reasoning = sum(p.reasoning_tokens for p in parsers)
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return usage

    def _chunks(self, update: ChoiceUpdate) -> list[bytes]:
        if self.chat:
            return self._chat_chunks(update)
        req, c, text = self.req, update.choice, update.text
        first = c.index not in self._started
        self._started.add(c.index)
        prompt = self.gen.prompts[c.prompt_index]
        if first and req.echo:
            text = self._prompt_text(prompt) + text
        if not (text or update.logprobs or req.return_token_ids or c.finished):
            return []
        stop_reason = c.stop_reason if c.finished else None
        choice = completion_choice(c.index, text, c.finish_reason, stop_reason)
        if req.logprobs is not None:
            offset = self._text_offsets.get(c.index, 0)
            echo = None
            if first and req.echo:
                echo = self.gen.echo_logprobs(c.prompt_index, req.logprobs)
            logprobs = self._fmt.completion(update.logprobs or [], offset, echo)
            self._text_offsets[c.index] = offset + sum(map(len, logprobs["tokens"]))
            choice["logprobs"] = logprobs
        if req.return_token_ids:
            choice["token_ids"] = update.token_ids
            if first:
                choice["prompt_token_ids"] = prompt.token_ids
        return [self._chunk([choice])]

    def _chat_chunks(self, update: ChoiceUpdate) -> list[bytes]:
        """Chat chunks through the choice's output parser: one chunk per reasoning, content or
        tool-call piece; the update's logprobs and token ids ride on its first chunk."""
        req, c = self.req, update.choice
        parser = self._parsers.get(c.index)
        if parser is None:
            assert self._chat_output is not None, "a chat stream needs its output parsers"
            parser = self._parsers[c.index] = self._chat_output()
        first = c.index not in self._started
        self._started.add(c.index)
        events = parser.feed(update.token_ids, update.text, c.finished).events
        if not events and (update.logprobs or req.return_token_ids):
            events = [("content", "")]
        chunks = []
        for i, (kind, value) in enumerate(events):
            if kind == "reasoning":
                delta = reasoning_delta(value)
            elif kind == "content":
                delta = {"content": value}
            else:
                delta = {"tool_calls": [value]}
            choice = chat_chunk_choice(c.index, delta, None, None)
            if i == 0:
                if req.logprobs:
                    choice["logprobs"] = self._fmt.chat(update.logprobs or [])
                if req.return_token_ids:
                    choice["token_ids"] = update.token_ids
                    if first:
                        choice["prompt_token_ids"] = self.gen.prompts[c.prompt_index].token_ids
                    first = False
            chunks.append(self._chunk([choice]))
        if c.finished:
            reason = parser.finish_reason(c.finish_reason)
            final = chat_chunk_choice(c.index, {}, reason, c.stop_reason)
            chunks.append(self._chunk([final]))
        return chunks
