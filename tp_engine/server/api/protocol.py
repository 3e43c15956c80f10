"""Request bodies of the HTTP API: OpenAI's fields plus vLLM's extras, validated by pydantic.

Strict types: a string where a number belongs, a float where an integer belongs or a boolean
where a number belongs is a 400, as OpenAI answers, not silently coerced. Unknown fields are
ignored (OpenAI clients send fields this server has no use for, such as `user`). Ranges are not
checked here but by `SamplingParams`, so the HTTP API and `LLM.generate` refuse the same values
with the same messages. Responses are built as plain dicts in `tp_engine.server.api.responses`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tp_engine.server.api.http_errors import APIError


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM: usage in every chunk, not only the last.
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Strict):
    """OpenAI's `response_format.json_schema`. `name` is optional here (OpenAI requires it, but
    nothing depends on it); `strict` is accepted and always holds: the schema is enforced."""

    name: str | None = None
    description: str | None = None
    # Aliased: `schema` is a (deprecated) BaseModel method.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: "text" (no constraint), "json_object" (any JSON object) or
    "json_schema" (a JSON value its schema validates)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs`: exactly one of its constraints (see
    `tp_engine.features.structured.grammar.StructuredOutputsParams`)."""

    # Aliased: `json` is a (deprecated) BaseModel method. A schema, or its text.
    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's options that would change what the constraint allows: refused (never ignored).
    # Backend hints and `disable_*` flags are ignored: whitespace is always fixed here.
    structural_tag: str | None = None
    whitespace_pattern: str | None = None


class _GenerationRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI's: token id (a string key, as JSON has them) -> bias in [-100, 100].
    logit_bias: dict[str, float] | None = None
    # vLLM's extras, passed to SamplingParams.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    # vLLM's: the only tokens that may be sampled, and words never to complete.
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    # vLLM: also return the prompt's and each choice's token ids.
    return_token_ids: bool = False
    # What the output must match (at most one source; see tp_engine/server/api/constraints.py).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's older names for structured_outputs' fields.
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Refused: it would change what guided_json allows. (guided_decoding_backend, a hint,
    # is ignored with the other unknown fields.)
    guided_whitespace_pattern: str | None = None
    # SGLang's prefill/decode pairing, as its router adds it (`disagg_fields`): the prefill's
    # bootstrap server and the pair's room, one or one per prompt.
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None


class CompletionRequest(_GenerationRequest):
    # Text, token ids, or a batch of either: each prompt gets `n` choices. Token ids first:
    # pydantic tries the members in order, and 1k ids tried as `list[str]` first make 1k errors
    # (0.2 ms) before `list[int]` takes them. A refusal is reported as `_ReportedCompletion`
    # (this order made none: each value fits one member, or `[]` all three lists alike).
    prompt: list[int] | str | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class _ReportedCompletion(CompletionRequest):
    """The model whose errors a refused completion body reports: `prompt`'s members in the
    order clients have always been told about them (text first)."""

    prompt: str | list[str] | list[int] | list[list[int]]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    # A JSON object as a string (OpenAI's shape); an object is accepted too.
    arguments: str | dict[str, Any]


class ToolCallMessage(_Strict):
    """A tool call in an assistant message of the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # Assistant messages: the calls the model made; tool messages: which call they answer.
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None
    # Assistant messages: their thinking, for templates that render it (vLLM's two names).
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    # A JSON schema of the arguments (checked with jsonschema when the request arrives).
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    # OpenAI's newer name for max_tokens; wins when both are given.
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Tool calling (needs a server started with --tool-call-parser; see tool_calls.py).
    tools: list[Tool] | None = None
    # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}; checked
    # by hand (tool_calls.tool_plan) so that every problem is a 400 naming tool_choice.
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat extras: template inputs...
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    add_special_tokens: bool = False
    # ... and the most tokens the model may think for (needs --reasoning-parser).
    thinking_token_budget: int | None = None


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    # With messages, the template's inputs as in a chat request.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    documents: list[dict[str, Any]] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# Union members' names that pydantic puts into error locations ("prompt.list[int].0").
_UNION_TAGS = ("str", "int", "float", "bool", "list", "dict", "none", "json-or-python")


def parse_body(model: type[_Strict], body: bytes) -> Any:
    """Validate a raw request body; every problem is a 400 naming the field."""
    if not body.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if model is CompletionRequest:  # as it is reported (see `_ReportedCompletion`)
            try:
                _ReportedCompletion.model_validate_json(body)
            except ValidationError as reported:
                errors = reported.errors(include_url=False)
        first = errors[0]
        if first["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON: {first['msg']}") from None
        loc = [
            str(part)
            for part in first["loc"]
            if not (isinstance(part, str) and (part in _UNION_TAGS or "[" in part))
        ]
        param = ".".join(loc) or None
        message = f"{param}: {first['msg']}" if param else first["msg"]
        if first["type"] == "model_type" and not loc:
            message = "the request body must be a JSON object"
        raise APIError(400, message, param=param) from None
