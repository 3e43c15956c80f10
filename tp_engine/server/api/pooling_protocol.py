"""Request bodies of the pooling routes, in vLLM's shapes (validated as `protocol` validates).

    /v1/embeddings, /pooling   EmbeddingRequest   OpenAI's: input as text(s) or token ids;
                                                  or vLLM's chat form, messages
    /classify                  ClassifyRequest    input as text(s) or token ids
    /score                     ScoreRequest       pairs: queries × documents (also vLLM's older
                                                  text_1/text_2 and data_1/data_2 spellings)
    /rerank, /v1/rerank,       RerankRequest      one query against documents, as texts or
                                                  {"text": ...} objects (Jina and Cohere)
    /v2/rerank

Only the types are checked here; what a value means (empty input, `dimensions` out of range,
`top_n` below 0, `truncate_prompt_tokens` beyond max_model_len) is `pooling_inputs`' business,
so that each refusal names its field.

`truncate_prompt_tokens` (every route, vLLM's): keep the last k tokens of each prompt before the
length check; -1 means max_model_len. `normalize` (embeddings) and `use_activation` (class
probabilities and a cross-encoder's scores; vLLM's older name `activation` too) go to rank 0 as
the `PoolingParams` fields of those names; unset: the model's default.
"""

from __future__ import annotations

from typing import Any

from tp_engine.server.api.protocol import ChatMessage, _Strict

# What `input` may be: one text, texts, one prompt's token ids, or several prompts' token ids.
PoolingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(_Strict):
    model: str | None = None
    # One of the two: `input` (OpenAI's), or `messages` (vLLM's chat embedding: the messages
    # through the chat template, the resulting text pooled as one prompt).
    input: PoolingInput | None = None
    messages: list[ChatMessage] | None = None
    # "base64": little-endian float32 bytes, what the official client asks for by default.
    # Any other value is a 400 naming the field (a `str` here so that the message says which
    # values are known, rather than pydantic's literal error).
    encoding_format: str = "float"
    # Matryoshka: keep the first `dimensions` values, then renormalise.
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extra: whether the tokenizer adds its special tokens (Qwen3-Embedding's appends
    # the <|endoftext|> it pools at). Token-id input is used as given. Unset: true for
    # `input`, false for `messages` (the template holds its own special tokens), vLLM's
    # defaults for its two request kinds.
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    # With `messages`, the template's inputs (vLLM's chat-embedding defaults: no generation
    # prompt).
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's per-request template: refused by name (the server's is --chat-template), rather
    # than silently ignored.
    chat_template: str | None = None


class ActivationChoice(_Strict):
    """False: the raw logits instead of the sigmoid / softmax."""

    use_activation: bool | None = None
    activation: bool | None = None  # vLLM's older name of use_activation


class ClassifyRequest(ActivationChoice):
    model: str | None = None
    input: PoolingInput
    user: str | None = None
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None


class ScoreRequest(ActivationChoice):
    """Scores of pairs: one query against one or more documents, or queries and documents
    pairwise (equal numbers)."""

    model: str | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    # Fills the reranker's prompt template (the model card's default task otherwise).
    instruction: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None


class RerankDocument(_Strict):
    """A document as an object (Jina's and Cohere's clients may send `{"text": ...}`)."""

    text: str


class RerankRequest(ActivationChoice):
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    # How many of the best documents to return; 0 (or unset): all of them.
    top_n: int | None = None
    instruction: str | None = None
    # Jina's default; Cohere's clients send false to get indices and scores only.
    return_documents: bool = True
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    # Cohere's: each document cut to its first k tokens before it is scored (the prompt's end,
    # where the reranker reads its answer, stays whole).
    max_tokens_per_doc: int | None = None


ENCODING_FORMATS: tuple[str, ...] = ("float", "base64")
