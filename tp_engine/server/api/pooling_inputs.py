"""The pooling routes' prompts and parameters: checked, formatted and tokenized on the request
pool (`request_work`), so that a refusal is a 400 naming its field before rank 0 sees anything.

    input (text, texts, token ids)  → prompts: token id lists, each within max_model_len
    messages (chat embeddings)      → one prompt: the chat template's text, tokenized
    truncate_prompt_tokens          → each prompt cut to its last k tokens before that check
    dimensions, encoding_format,    → `PoolingParams` fields (a Matryoshka cut only where the
    normalize, use_activation         model was trained for it)
    queries × documents             → pairs: one query against every document, or pairwise;
                                      a cross-encoder reads each pair as one prompt, filled
                                      into the reranker's template with the instruction
                                      (or taken as they are where they carry it already)
    documents as {"text": ...},     → texts; each cut to its first k tokens (Cohere's
    max_tokens_per_doc                max_tokens_per_doc) before it is scored
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tp_engine.features.pooling.rerank_prompt import truncate_document
from tp_engine.server.api.http_errors import bad_request
from tp_engine.server.api.pooling_protocol import (
    ENCODING_FORMATS,
    ActivationChoice,
    EmbeddingRequest,
    PoolingInput,
    RerankDocument,
    ScoreRequest,
)
from tp_engine.server.api.prompts import PromptBuilder

# Unicode normalization (NFC) composes at most a few characters into one (`PromptBuilder`'s
# length check allows as much).
_NORMALIZING_SLACK = 4
# A reranker's prompt of one (query, document, instruction) as token ids, made with the given
# tokenizer (`tp_engine.features.pooling.rerank_prompt.rerank_token_ids`).
PairTokens = Callable[[Any, str, str, str | None], list[int]]


class PoolingInputs:
    def __init__(
        self,
        builder: PromptBuilder,
        pooled_size: int,
        is_matryoshka: bool,
        pair_tokens: PairTokens | None,
    ) -> None:
        self.builder = builder
        self.tokenizer = builder.tokenizer
        self.pooled_size = pooled_size
        self.is_matryoshka = is_matryoshka
        self.pair_tokens = pair_tokens

    # -- prompts -----------------------------------------------------------------------------------

    def prompts(
        self, value: PoolingInput, add_special_tokens: bool, keep_last: int | None = None
    ) -> list[list[int]]:
        """`input` as token id lists: texts tokenized (with the special tokens the tokenizer
        adds, unless told not to), token ids used as given; each cut to its last `keep_last`
        tokens (`truncation`) when set."""
        if isinstance(value, str):
            value = [value]
        if not value or any(len(item) == 0 for item in value if not isinstance(item, int)):
            raise bad_request("input must not be empty (nor hold an empty item)", "input")
        if isinstance(value[0], int):
            prompts = [self.builder.check_token_ids(value, "input")]  # type: ignore[arg-type]
        elif isinstance(value[0], list):
            prompts = [self.builder.check_token_ids(ids, "input") for ids in value]  # type: ignore[arg-type]
        else:
            prompts = self.tokenize(value, add_special_tokens, "input")  # type: ignore[arg-type]
        prompts = truncated(prompts, keep_last)
        self.check_lengths(prompts, "input")
        return prompts

    def embedding_prompts(
        self, req: EmbeddingRequest, keep_last: int | None = None
    ) -> list[list[int]]:
        """An embedding request's prompts: its `input`, or its `messages` as one prompt."""
        if (req.input is None) == (req.messages is None):
            raise bad_request("give either input or messages (vLLM's chat embedding)", "input")
        if req.input is not None:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            return self.prompts(req.input, add, keep_last)
        return [self.chat_prompt(req, keep_last)]

    def chat_prompt(self, req: EmbeddingRequest, keep_last: int | None) -> list[int]:
        """vLLM's chat embedding: the messages through the chat template (no generation prompt
        unless asked), the text tokenized without adding special tokens unless asked (the
        template wrote its own), cut and checked as `prompts` does."""
        if req.chat_template is not None:
            raise bad_request(
                "a per-request chat_template is not served; start the server with "
                "--chat-template (a file or an inline template)",
                "chat_template",
            )
        if not req.messages:
            raise bad_request("messages must not be empty", "messages")
        if req.add_generation_prompt and req.continue_final_message:
            raise bad_request(
                "add_generation_prompt and continue_final_message cannot both be true",
                "continue_final_message",
            )
        text = self.builder.render_chat(
            req.messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            kwargs=req.chat_template_kwargs,
        )
        self.builder.check_text_length(text, "messages")
        ids = list(
            self.tokenizer(text, add_special_tokens=bool(req.add_special_tokens))["input_ids"]
        )
        if not ids:
            raise bad_request("the messages encode to no tokens", "messages")
        prompts = truncated([ids], keep_last)
        self.check_lengths(prompts, "messages")
        return prompts[0]

    def tokenize(self, texts: list[str], add_special_tokens: bool, param: str) -> list[list[int]]:
        for text in texts:
            self.builder.check_text_length(text, param)
        return [
            list(ids)
            for ids in self.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
        ]

    def check_lengths(self, prompts: list[list[int]], param: str) -> None:
        """vLLM's context-length refusal: a pooled prompt is computed whole, so each must fit
        max_model_len."""
        limit = self.builder.max_model_len
        longest = max(len(p) for p in prompts)
        if longest > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {longest} tokens in the {param} for pooling. Please reduce the "
                f"length of the {param}.",
                param,
            )

    def truncation(self, truncate_prompt_tokens: int | None) -> int | None:
        """How many last tokens of each prompt vLLM's `truncate_prompt_tokens` keeps (None: all
        of them). -1 stands for max_model_len; more than max_model_len could never fit."""
        if truncate_prompt_tokens is None:
            return None
        limit = self.builder.max_model_len
        if truncate_prompt_tokens == -1:
            return limit
        if truncate_prompt_tokens < 1:
            raise bad_request(
                f"truncate_prompt_tokens must be -1 or at least 1, got {truncate_prompt_tokens}",
                "truncate_prompt_tokens",
            )
        if truncate_prompt_tokens > limit:
            raise bad_request(
                f"truncate_prompt_tokens ({truncate_prompt_tokens}) is greater than "
                f"max_model_len ({limit}); ask for a smaller truncation",
                "truncate_prompt_tokens",
            )
        return truncate_prompt_tokens

    # -- parameters --------------------------------------------------------------------------------

    def embed_fields(
        self, dimensions: int | None, encoding_format: str, normalize: bool | None
    ) -> dict[str, Any]:
        """The `PoolingParams` fields of an embedding request (`normalize` only when set, so
        that the model's own default holds otherwise)."""
        if encoding_format not in ENCODING_FORMATS:
            raise bad_request(
                f"encoding_format must be one of {list(ENCODING_FORMATS)}, got {encoding_format!r}",
                "encoding_format",
            )
        if dimensions is not None:
            self.check_dimensions(dimensions)
        fields: dict[str, Any] = {"task": "embed", "dimensions": dimensions}
        if normalize is not None:
            fields["normalize"] = normalize
        return fields

    def check_dimensions(self, dimensions: int) -> None:
        """vLLM's wording: a cut is only meaningful for a Matryoshka-trained model."""
        if not self.is_matryoshka:
            raise bad_request(
                f"Model does not support Matryoshka embeddings; dimensions must be unset "
                f"(received dimensions={dimensions}). A Matryoshka model says so in its config "
                "or with --hf-overrides '{\"is_matryoshka\": true}'",
                "dimensions",
            )
        if not 1 <= dimensions <= self.pooled_size:
            raise bad_request(
                f"Model only supports dimensions in range [1, {self.pooled_size}] "
                f"(received dimensions={dimensions})",
                "dimensions",
            )

    # -- pairs -------------------------------------------------------------------------------------

    def pair_prompts(
        self,
        queries: list[str],
        documents: list[str],
        instruction: str | None,
        keep_last: int | None = None,
    ) -> list[list[int]]:
        """Each (query, document) pair as one cross-encoder prompt, in the reranker's template
        (which holds every special token it needs: nothing is added), cut as `prompts` cuts."""
        if self.pair_tokens is None:
            raise bad_request("this model cannot score pairs of texts")
        for text in (*dict.fromkeys(queries), *documents, instruction or ""):
            self.builder.check_text_length(text, "documents")
        try:
            prompts = [
                self.pair_tokens(self.tokenizer, q, d, instruction)
                for q, d in zip(queries, documents, strict=True)
            ]
        except ValueError as exc:  # an instruction beside texts that carry the template
            raise bad_request(str(exc), "instruction") from None
        prompts = truncated(prompts, keep_last)
        self.check_lengths(prompts, "documents")
        return prompts

    def rerank_documents(
        self, documents: list[str | RerankDocument], max_tokens_per_doc: int | None
    ) -> list[str]:
        """The texts a rerank request scores: objects read for their `text`, each cut to its
        first `max_tokens_per_doc` tokens (Cohere's field; a document longer than the context
        is then served, where it was a 400)."""
        texts = [d if isinstance(d, str) else d.text for d in documents]
        check_documents(texts)
        if max_tokens_per_doc is None:
            return texts
        if max_tokens_per_doc < 1:
            raise bad_request(
                f"max_tokens_per_doc must be at least 1, got {max_tokens_per_doc}",
                "max_tokens_per_doc",
            )
        if any("<|im_start|>" in text for text in texts):
            # Cutting such a document would cut the template's suffix off with it.
            raise bad_request(
                "max_tokens_per_doc cannot cut a document that carries the reranker's "
                "template; cut the text before formatting it",
                "max_tokens_per_doc",
            )
        # No token spans more than max_token_chars characters (`PromptBuilder`), so the first
        # k + 1 tokens lie within this many: a long document is cut to it before tokenizing
        # (the tokenizer never sees megabytes), the first k tokens unchanged.
        chars = (max_tokens_per_doc + 1) * self.builder.max_token_chars * _NORMALIZING_SLACK
        return [truncate_document(self.tokenizer, t[:chars], max_tokens_per_doc) for t in texts]

    def text_prompts(self, texts: list[str], keep_last: int | None = None) -> list[list[int]]:
        """Texts an embedding model scores against each other, one prompt each."""
        prompts = truncated(self.tokenize(texts, True, "documents"), keep_last)
        self.check_lengths(prompts, "documents")
        return prompts


def truncated(prompts: list[list[int]], keep_last: int | None) -> list[list[int]]:
    """vLLM truncates on the left: the end of a prompt is what a last-token pooler reads."""
    if keep_last is None:
        return prompts
    return [p[-keep_last:] for p in prompts]


def score_pairs(req: ScoreRequest) -> tuple[list[str], list[str]]:
    """The (query, document) pairs of a /score request, as vLLM pairs them: one query with each
    document, or queries and documents one to one. Accepts vLLM's three spellings."""
    spellings = (("queries", "documents"), ("text_1", "text_2"), ("data_1", "data_2"))
    given = [(q, d) for q, d in spellings if getattr(req, q) is not None]
    if len(given) != 1 or getattr(req, given[0][1]) is None:
        raise bad_request("give queries and documents (or text_1 and text_2)", "queries")
    query_field, doc_field = given[0]
    queries = _as_list(getattr(req, query_field))
    documents = _as_list(getattr(req, doc_field))
    if not queries or any(not q for q in queries):
        raise bad_request(f"{query_field} must not be empty", query_field)
    check_documents(documents, doc_field)
    if len(queries) == 1:
        queries = queries * len(documents)
    elif len(queries) != len(documents):
        raise bad_request(
            f"{query_field} has {len(queries)} items and {doc_field} {len(documents)}: give one "
            "query, or as many queries as documents",
            doc_field,
        )
    return queries, documents


def activation_fields(req: ActivationChoice) -> dict[str, Any]:
    """The `PoolingParams.use_activation` a request asks for, under either of vLLM's names
    (none when unset: the model's default, probabilities)."""
    if None not in (req.use_activation, req.activation) and req.use_activation != req.activation:
        raise bad_request(
            "use_activation and activation (its older name) disagree; give one of them",
            "activation",
        )
    value = req.activation if req.use_activation is None else req.use_activation
    return {} if value is None else {"use_activation": value}


def check_documents(documents: list[str], param: str = "documents") -> None:
    if not documents:
        raise bad_request(f"{param} must not be empty", param)
    if any(not d for d in documents):
        raise bad_request(f"{param} must not hold an empty text", param)


def check_top_n(top_n: int | None) -> int | None:
    """Jina's `top_n`: None or 0 returns every document."""
    if top_n is not None and top_n < 0:
        raise bad_request(f"top_n must be >= 0, got {top_n}", "top_n")
    return top_n or None


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)
