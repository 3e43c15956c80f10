"""One HTTP request's sequences on their way through the engine, in the API process.

A request with P prompts and `n` choices per prompt becomes P engine requests (ids
`<request id>-<prompt index>`), each with `n` samples that the engine runs as sequences sharing
the prompt's KV blocks; choice `p * n + i` is sample i of prompt p, as OpenAI numbers them.
Their life:

    start(): Add each (`send`) → wait until every one is accepted or one is rejected
             (a rejection aborts the others and becomes this request's 400 / 503)
    updates(): each Delta → detokenize, match stop strings, record metrics → ChoiceUpdate;
             a stop string ends the choice here and tells rank 0 to stop that sample
    close(): in a `finally`: aborts whatever has not finished (the client went away)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from tp_engine.frontend.detokenizer import IncrementalDetokenizer
from tp_engine.lora_request import LoRARequest
from tp_engine.sampling_params import SamplingParams
from tp_engine.server.api.engine_client import ACCEPTED, EngineClient, EngineDied
from tp_engine.server.api.http_errors import APIError
from tp_engine.server.api.logprob_format import Entry, cut_top
from tp_engine.server.api.metrics import RequestTimes
from tp_engine.server.messages import Bootstrap, Delta, Rejected, TokenLogprobs


class EngineDiedError(RuntimeError):
    """The engine died while this request was in flight."""


class RequestFailedError(RuntimeError):
    """This request failed on its own (its prefill/decode transfer): the API answers 500."""


@dataclass
class PromptInput:
    token_ids: list[int]
    text: str | None = None  # the prompt's text, when echo needs it


@dataclass
class Choice:
    index: int
    prompt_index: int
    sample_index: int
    detok: IncrementalDetokenizer
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    queue_time_s: float | None = None
    # time.monotonic() of its first scheduling on rank 0, and of its first and last tokens here.
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    # Per output token, when logprobs were asked for: token ids, logprobs, rank (the sampled
    # token first, then the top-k).
    logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ChoiceUpdate:
    choice: Choice
    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None  # of `token_ids`, when asked for


@dataclass(frozen=True)
class StopOptions:
    """What the API process does with the text (the engine never sees these)."""

    stop: list[str]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    min_tokens: int


class Generation:
    def __init__(
        self,
        client: EngineClient,
        tokenizer: Any,
        request_id: str,
        prompts: list[PromptInput],
        params_for: Callable[[int], SamplingParams],
        n: int,
        stop: StopOptions,
        adapter: LoRARequest | None = None,
        constraint_checks: dict[str, dict[str, Any]] | None = None,
        bootstrap: list[Bootstrap | None] | None = None,
    ) -> None:
        self.client = client
        # Each prompt's prefill/decode pairing, when a router sent one (`disagg_fields`).
        self.bootstrap = bootstrap
        # The output constraint's parses, by the field each names: rank 0 runs them (`constraints`).
        self.constraint_checks = constraint_checks or {}
        # The LoRA adapter the request's `model` picked (None: the base model).
        self.adapter = adapter
        self.request_id = request_id
        self.prompts = prompts
        self.arrival = time.monotonic()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._params_for = params_for
        self.engine_ids = [f"{request_id}-{p}" for p in range(len(prompts))]
        self.choices: list[Choice] = []
        for p in range(len(prompts)):
            for i in range(n):
                detok = IncrementalDetokenizer(
                    tokenizer,
                    skip_special_tokens=stop.skip_special_tokens,
                    stop=stop.stop,
                    include_stop_str_in_output=stop.include_stop_str_in_output,
                    min_tokens=stop.min_tokens,
                )
                self.choices.append(Choice(p * n + i, p, i, detok))
        self._n = n
        self._prompt_of = {rid: p for p, rid in enumerate(self.engine_ids)}
        # Per prompt, when prompt_logprobs were asked for (from sample 0's first Delta).
        self.prompt_logprobs: list[list[TokenLogprobs | None] | None] = [None] * len(prompts)
        self._early: list[tuple[str, Any]] = []
        self._sent = False  # whether `send` has handed the prompts to rank 0

    def deliver(self, engine_id: str, event: Any) -> None:
        """Hand this request an event as if rank 0 had sent it (SGLang's /abort_request ends
        a sample that rank 0 then drops without a word)."""
        self._queue.put_nowait((engine_id, event))

    # -- life --------------------------------------------------------------------------------------

    def send(self) -> None:
        """Hand every prompt to rank 0 (once; `start` does it if it was not done): the
        request-pool thread that built this Generation sends it (`serving`), and a caller
        about to wait for the verdict in a task of its own sends first, so that the
        AddRequest leaves without waiting a turn of the event loop. APIError (503) when the
        engine cannot take it. From the loop or a request-pool thread (`EngineClient`)."""
        if self._sent:
            return
        client = self.client
        fields = [self._params_for(p).as_fields() for p in range(len(self.prompts))]
        with client.admitting:  # the engine is not marked dead between the check and the adds
            if client.dead is not None:
                raise APIError(503, f"the engine is dead: {client.dead}", code="engine_dead")
            if client.draining:
                raise APIError(503, "the server is shutting down; retry elsewhere")
            self._sent = True
            for p, engine_id in enumerate(self.engine_ids):
                client.add(
                    self._queue,
                    engine_id,
                    self.prompts[p].token_ids,
                    fields[p],
                    lora_request=self.adapter,
                    constraint_checks=self.constraint_checks,
                    bootstrap=None if self.bootstrap is None else self.bootstrap[p],
                )

    async def start(self) -> None:
        """Hand every prompt to rank 0 (`send`) and wait for its verdict; raises APIError if
        refused."""
        self.send()
        pending = set(self.engine_ids)
        rejection: Rejected | None = None
        while pending:
            engine_id, event = await self._queue.get()
            if isinstance(event, EngineDied):
                raise APIError(503, f"the engine is dead: {event.message}", code="engine_dead")
            if event == ACCEPTED:
                pending.discard(engine_id)
            elif isinstance(event, Rejected):
                pending.discard(engine_id)
                rejection = rejection or event
                for c in self._choices_of(engine_id):
                    c.finish_reason = "rejected"
            else:
                self._early.append((engine_id, event))
        if rejection is not None:
            self.close()
            # A 404: the adapter its `model` named was unloaded meanwhile (vLLM's NotFoundError).
            kind = "NotFoundError" if rejection.status == 404 else None
            raise APIError(rejection.status, rejection.message, type=kind, param=rejection.param)

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        """Updates of every choice, in arrival order, until all have finished."""
        while not all(c.finished for c in self.choices):
            if self._early:
                engine_id, event = self._early.pop(0)
            else:
                engine_id, event = await self._queue.get()
            if isinstance(event, EngineDied):
                raise EngineDiedError(event.message)
            if isinstance(event, Delta) and event.error is not None:
                raise RequestFailedError(event.error)
            if isinstance(event, Delta) and 0 <= event.index < self._n:
                choice = self.choices[self._prompt_of[engine_id] * self._n + event.index]
                update = self._apply(choice, event)
                if update is not None:
                    yield update

    def close(self) -> None:
        """Abort every unfinished choice on rank 0. Synchronous: safe in a cancelled `finally`."""
        for engine_id in self.engine_ids:
            if all(c.finished for c in self._choices_of(engine_id)):
                self.client.release(engine_id)
            else:
                self.client.abort(engine_id)

    def _choices_of(self, engine_id: str) -> list[Choice]:
        p = self._prompt_of[engine_id]
        return self.choices[p * self._n : (p + 1) * self._n]

    # -- one delta ---------------------------------------------------------------------------------

    def _apply(self, choice: Choice, delta: Delta) -> ChoiceUpdate | None:
        if choice.finished:
            return None  # ended by a stop string; rank 0 had already sent more
        now = time.monotonic()
        if delta.num_cached_tokens is not None:
            choice.num_cached_tokens = delta.num_cached_tokens
        if delta.queue_time_s is not None:
            choice.queue_time_s = delta.queue_time_s
        if delta.scheduled_at is not None:
            choice.scheduled_at = delta.scheduled_at
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs[choice.prompt_index] = delta.prompt_logprobs
        engine_done = delta.finish_reason is not None
        was_finished, before = choice.detok.finished, len(choice.detok.token_ids)
        text = choice.detok.update(
            delta.new_token_ids,
            engine_stopped=delta.finish_reason == "stop",
            finished=engine_done,
        )
        new_ids, new_logprobs = list(delta.new_token_ids), delta.logprobs
        kept = len(choice.detok.token_ids) - before
        if not was_finished and kept < len(new_ids):
            # A stop string completed within a speculative step: the tokens after it never were.
            new_ids = new_ids[:kept]
            new_logprobs = None if new_logprobs is None else new_logprobs[:kept]
        if new_ids:
            self._record_tokens(choice, len(new_ids), now)
        if new_logprobs is not None:
            choice.logprobs = (choice.logprobs or []) + new_logprobs
        if choice.detok.stop_string is not None:
            choice.finish_reason, choice.stop_reason = "stop", choice.detok.stop_string
            if not engine_done:
                engine_id = self.engine_ids[choice.prompt_index]
                self.client.abort(engine_id, [choice.sample_index], stopped=True)
        elif engine_done:
            choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
        if choice.finished:
            self._record_finish(choice, now)
        return ChoiceUpdate(choice, text, new_ids, new_logprobs)

    def _record_tokens(self, choice: Choice, num_tokens: int, now: float) -> None:
        """`num_tokens` output tokens of `choice` arrived at `now` (several after a speculative
        step; tokens after a stop string are not output). Generation tokens count each, and
        inter-token latency has one observation per token after the first: a delta's gap
        since the previous one is spread evenly over its tokens (the first delta's later
        tokens came with the first: no gap), so its observations sum to the decode time and
        their mean is the time per output token. (`benchmarks/serving_client.py` times
        streamed chunks the same way.)"""
        metrics = self.client.metrics
        metrics.generation_tokens.inc(num_tokens)
        if choice.first_token_at is None:
            choice.first_token_at = now
            metrics.ttft.observe(now - self.arrival)
            metrics.prompt_tokens.inc(len(self.prompts[choice.prompt_index].token_ids))
            gaps = [0.0] * (num_tokens - 1)
        else:
            gaps = [(now - (choice.last_token_at or now)) / num_tokens] * num_tokens
        for gap in gaps:
            metrics.itl.observe(gap)
        choice.last_token_at = now

    def _record_finish(self, choice: Choice, now: float) -> None:
        metrics = self.client.metrics
        metrics.request_finished(
            choice.finish_reason or "abort",
            num_prompt_tokens=len(self.prompts[choice.prompt_index].token_ids),
            num_generated_tokens=len(choice.detok.token_ids),
            e2e_s=now - self.arrival,
            queue_time_s=choice.queue_time_s,
            times=RequestTimes(choice.scheduled_at, choice.first_token_at, choice.last_token_at),
        )
        samples = self._choices_of(self.engine_ids[choice.prompt_index])
        if all(c.finished for c in samples):
            metrics.samples_finished([len(c.detok.token_ids) for c in samples])

    # -- totals ------------------------------------------------------------------------------------

    def echo_logprobs(
        self, prompt_index: int, num_top: int
    ) -> tuple[list[int], list[Entry | None]]:
        """A prompt's token ids and logprob entries, each cut to `num_top` top tokens, for a
        completion that echoes its prompt with logprobs (vLLM's shape). A request aborted before
        its prompt was computed has none: null logprobs then."""
        ids = self.prompts[prompt_index].token_ids
        entries = self.prompt_logprobs[prompt_index] or [None] * len(ids)
        return ids, cut_top(entries, num_top)

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage: each prompt counted once, every choice's tokens counted."""
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        completion_tokens = sum(len(c.detok.token_ids) for c in self.choices)
        cached: dict[int, int] = {}
        for c in self.choices:
            cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), c.num_cached_tokens)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
        }
