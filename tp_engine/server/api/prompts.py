"""From a request body to what the engine runs: prompt token ids and `SamplingParams`.

Everything a request can get wrong is found here, before anything reaches rank 0, and becomes
a 400 naming the field: empty prompts, token ids outside the vocabulary, a prompt plus
completion longer than the context, out-of-range sampling values, features this server does not
implement. The engine checks again (what it refuses it answers with a 400 too).
"""

from __future__ import annotations

import functools
import re
from typing import Any

from tp_engine.common.thinking import budget_fields
from tp_engine.sampling_params import SamplingParams, tokenize_bad_words
from tp_engine.server.api.chat_parsers import ChatParsing
from tp_engine.server.api.generation import PromptInput, StopOptions
from tp_engine.server.api.http_errors import APIError, bad_request
from tp_engine.server.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    Tool,
)
from tp_engine.server.api.tool_calls import history_tool_calls
from tp_engine.server.messages import Hello

# Most choices one request may ask for (prompts × n), so that one request cannot fill the queue.
MAX_CHOICES = 128
_FIELD = re.compile(r"^SamplingParams\.(\w+) ")
# Arguments of `apply_chat_template` that chat_template_kwargs may not override: the request's
# own fields set them, or they would make it return something other than the prompt's text.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


# Unicode normalization (Qwen's tokenizer applies NFC) composes at most a few characters into
# one: the length check allows for it.
_NORMALIZING_SLACK = 4


class PromptBuilder:
    def __init__(self, tokenizer: Any, hello: Hello, parsing: ChatParsing | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = hello.max_model_len
        self.vocab_size = hello.vocab_size
        self.generation_defaults = dict(hello.generation_defaults)
        self.parsing = parsing or ChatParsing()

    @functools.cached_property
    def max_token_chars(self) -> int:
        """No token of this tokenizer stands for more characters than its longest vocabulary
        entry has (byte-level: one character a byte), so a text of more than max_model_len *
        this * _NORMALIZING_SLACK characters cannot fit in max_model_len tokens."""
        return max(map(len, self.tokenizer.get_vocab()), default=1)

    def check_text_length(self, text: str, param: str) -> None:
        """A 400 naming `param` for a text that cannot fit max_model_len tokens, before the
        tokenizer spends seconds on it."""
        limit = self.max_model_len * self.max_token_chars * _NORMALIZING_SLACK
        if self.max_model_len and len(text) > limit:
            raise bad_request(
                f"{param} has {len(text)} characters; the longest token of this model's "
                f"tokenizer is {self.max_token_chars} characters, so it needs more than "
                f"max_model_len ({self.max_model_len}) tokens",
                param,
            )

    # -- prompts -----------------------------------------------------------------------------------

    def completion_prompts(self, req: CompletionRequest) -> list[PromptInput]:
        raw = req.prompt
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            raw = [raw]  # one prompt: text or token ids
        if not raw:
            raise bad_request("prompt must not be empty", "prompt")
        prompts = []
        for item in raw:
            if isinstance(item, str):
                if not item:
                    raise bad_request("prompt must not be empty", "prompt")
                self.check_text_length(item, "prompt")
                ids = self.tokenizer(item, add_special_tokens=req.add_special_tokens)["input_ids"]
                prompts.append(PromptInput(list(ids), item))
            else:
                prompts.append(PromptInput(self.check_token_ids(item, "prompt")))
        for prompt in prompts:
            if not prompt.token_ids:
                raise bad_request("the prompt encodes to no tokens", "prompt")
        return prompts

    def chat_prompt(self, req: ChatCompletionRequest) -> PromptInput:
        text = self.render_chat(
            req.messages,
            add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
            continue_final_message=req.continue_final_message,
            kwargs=req.chat_template_kwargs,
            tools=req.tools,
            documents=req.documents,
        )
        self.check_text_length(text, "messages")
        ids = self.tokenizer(text, add_special_tokens=req.add_special_tokens)["input_ids"]
        if not ids:
            raise bad_request("the messages encode to no tokens", "messages")
        return PromptInput(list(ids), text)

    def render_chat(
        self,
        messages: list[ChatMessage],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool = False,
        kwargs: dict[str, Any] | None = None,
        tools: list[Tool] | None = None,
        documents: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt's text: the messages, tools and documents through the checkpoint's chat
        template, with `kwargs` (chat_template_kwargs, e.g. enable_thinking) as its variables."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(kwargs or {}))
        if reserved:
            raise bad_request(
                f"chat_template_kwargs may not set {reserved[0]!r} (a request field sets it, "
                "or it is not a template variable)",
                "chat_template_kwargs",
            )
        conversation = [_message_dict(m, f"messages.{i}") for i, m in enumerate(messages)]
        try:
            return self.tokenizer.apply_chat_template(
                conversation,
                tools=[t.model_dump(exclude_none=True) for t in tools] if tools else None,
                documents=documents or None,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(kwargs or {}),
            )
        except Exception as exc:  # jinja2 raises its own types for a bad template input
            raise bad_request(f"the chat template failed: {exc}", "messages") from None

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's `GET /tokenizer_info`: what a client needs to tokenize and template prompts as
        the server does. lm-eval's local-completions reads `eos_token` (its probe for the route),
        `bos_token`, `pad_token` and `chat_template`. `model_max_length` is the server's context
        limit rather than the tokenizer file's (often a placeholder like 1e30)."""
        tok = self.tokenizer
        return {
            "tokenizer_class": type(tok).__name__,
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "pad_token": tok.pad_token,
            "unk_token": tok.unk_token,
            "chat_template": getattr(tok, "chat_template", None),
            "model_max_length": self.max_model_len,
        }

    def check_token_ids(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise bad_request(f"{param} must not be empty", param)
        if min(ids) >= 0 and max(ids) < self.vocab_size:  # C loops: the common case, fast
            return list(ids)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(
                f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})", param
            )
        return list(ids)

    # -- limits ------------------------------------------------------------------------------------

    def check_fits(self, prompt_len: int, max_tokens: int | None, what: str) -> None:
        """OpenAI's context-length error, before the engine would refuse the same request.

        `max_tokens` None: the completion may use whatever room the prompt leaves.
        """
        limit = self.max_model_len
        param = "messages" if what == "messages" else "prompt"
        if max_tokens is None:
            if prompt_len < limit:
                return
            message = (
                f"This model's maximum context length is {limit} tokens. However, your {what} "
                f"has {prompt_len} tokens, leaving no room for the completion. Please reduce "
                f"the length of the {what}."
            )
        elif prompt_len + max_tokens <= limit:
            return
        else:
            message = (
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the {what}, {max_tokens} for "
                f"the completion). Please reduce the length of the {what} or completion."
            )
        raise APIError(400, message, param=param, code="context_length_exceeded")

    def default_max_tokens(self, prompt_len: int) -> int:
        """Chat's max_tokens when the request gives none (vLLM's rule): the room the prompt
        leaves, capped by the checkpoint's max_new_tokens."""
        room = self.max_model_len - prompt_len
        default = self.generation_defaults.get("max_tokens")
        return min(room, default) if default else room

    # -- sampling ----------------------------------------------------------------------------------

    def thinking_fields(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        prompt: PromptInput,
        constrained: bool = False,
    ) -> dict[str, Any]:
        """The SamplingParams fields of a chat request's thinking: with a budget, the budget,
        the think token ids and whether the prompt left thinking open; with an output
        constraint (`constrained`) and --reasoning-parser, the think token ids, so that the
        constraint applies after the thinking (`tp_engine.features.structured.grammar`)."""
        budget = getattr(req, "thinking_token_budget", None)
        think = self.parsing.think
        if budget is None:
            if constrained and think is not None:
                return budget_fields(think, prompt.token_ids)
            return {}
        if think is None:
            raise bad_request(
                "thinking_token_budget needs a server started with --reasoning-parser",
                "thinking_token_budget",
            )
        return {"thinking_token_budget": budget, **budget_fields(think, prompt.token_ids)}

    def sampling_params(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        max_tokens: int | None,
        extra: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """The engine's parameters for one choice (a new object on every call); `extra`: more
        fields (`thinking_fields`)."""
        prompt_logprobs = req.prompt_logprobs
        if isinstance(req, ChatCompletionRequest):
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
        else:
            logprobs = req.logprobs
            if req.echo and prompt_logprobs is None:
                # Echoed logprobs cover the prompt too (vLLM): its tokens' logprobs are needed.
                prompt_logprobs = logprobs
        fields: dict[str, Any] = {
            "n": req.n,
            "max_tokens": max_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "min_p": req.min_p,
            "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty,
            "repetition_penalty": req.repetition_penalty,
            "seed": req.seed,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "stop": _stop_list(req.stop),
            "stop_token_ids": req.stop_token_ids,
            "ignore_eos": req.ignore_eos,
            "min_tokens": req.min_tokens,
            "skip_special_tokens": req.skip_special_tokens,
            "logit_bias": req.logit_bias or None,
            "allowed_token_ids": req.allowed_token_ids,
            "bad_words": req.bad_words or None,
            **(extra or {}),
        }
        try:
            # Unset (None) fields take the checkpoint's generation-config defaults, as in vLLM.
            params = SamplingParams.from_optional(self.generation_defaults, **fields)
            # Here rather than on rank 0: tokenizing is the API process's work.
            params = tokenize_bad_words(params, self.tokenizer)
            params.check_vocab(self.vocab_size)
            # Without the EOS ids, which rank 0 adds to this check (its refusal is a 400 too).
            params.check_first_step(self.vocab_size)
        except ValueError as exc:
            raise _sampling_error(exc) from None
        if params.stop_token_ids and max(params.stop_token_ids) >= self.vocab_size:
            raise bad_request(
                f"stop_token_ids must be below the vocabulary size {self.vocab_size}",
                "stop_token_ids",
            )
        return params

    def stop_options(self, req: CompletionRequest | ChatCompletionRequest) -> StopOptions:
        return StopOptions(
            stop=_stop_list(req.stop),
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            min_tokens=req.min_tokens,
        )


def check_choices(num_prompts: int, n: int) -> None:
    if n < 1:
        raise bad_request(f"n must be an integer >= 1, got {n}", "n")
    if num_prompts * n > MAX_CHOICES:
        raise bad_request(
            f"{num_prompts} prompts x n={n} = {num_prompts * n} choices; at most {MAX_CHOICES} "
            "per request",
            "n",
        )


def check_max_tokens(req: CompletionRequest | ChatCompletionRequest) -> None:
    """0 tokens is a prompt-only request, which only completions with echo ask for (scoring
    clients such as lm-eval: the prompt's logprobs, nothing generated); elsewhere it is a 400,
    as in OpenAI's API. Other values are checked by SamplingParams."""
    if isinstance(req, CompletionRequest) and req.echo:
        return
    for name in ("max_tokens", "max_completion_tokens"):
        if getattr(req, name, None) == 0:
            raise bad_request(f"{name} must be at least 1 (0 only with echo)", name)


def refuse_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Features clients may ask for that this server does not implement: say so, never ignore."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options can only be given with stream=true", "stream_options")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of other than n is not supported", "best_of")
    else:
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _message_dict(message: ChatMessage, param: str) -> dict[str, Any]:
    """A history message as chat templates read it (Qwen3's reads tool_calls, tool_call_id and
    reasoning_content)."""
    out: dict[str, Any] = {"role": message.role, "content": _text_of(message)}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = history_tool_calls(message.tool_calls, f"{param}.tool_calls")
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    reasoning = (
        message.reasoning_content if message.reasoning_content is not None else message.reasoning
    )
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    return out


def _text_of(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "\n".join(part.text for part in message.content)


def _sampling_error(exc: ValueError) -> APIError:
    message = str(exc)
    match = _FIELD.match(message)
    param = match.group(1) if match else None
    return bad_request(message.removeprefix("SamplingParams."), param)
