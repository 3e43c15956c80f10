"""The Qwen3-Reranker prompt of its model card, in one place (`LLM.score` and the server's
`/score` and `/rerank` use it).

The reranker is a causal LM asked whether a document meets a query; its score is P("yes")
over {"no", "yes"} after this prompt. The model card builds it as prefix + body + suffix,
each part tokenized without special tokens; the body is

    <Instruct>: {instruction}\\n<Query>: {query}\\n<Document>: {document}

with single newlines (the README's transformers recipe; Qwen's vLLM example uses double ones,
which tokenize differently and score differently). Without the template a reranker scores raw
concatenations and ranks badly (vLLM #20478, Qwen3-Embedding #71).

Two ways in, both scored right:

    raw text (this project's convention)   query "what is a cache", document "The cache ..."
                                           → filled into the template here
    text that carries the template          query RERANK_PREFIX + "<Instruct>: ...\\n<Query>: ...\\n",
    (vLLM's documented form:                document "<Document>: ..." + RERANK_SUFFIX
    examples/offline_inference/             → scored as it is: query tokens + document
    qwen3_reranker.py, vLLM-Ascend's          tokens, as vLLM's pair tokenization joins them
    tutorial, code copied from them)

A pair carries the template when its query starts with `<|im_start|>` or its document holds
`<|im_start|>assistant`: chat-turn markers that no raw query or passage holds. Wrapping such a
pair a second time scored it wrong with a 200 (issue 43: 0.06 off on a spread of 0.04).
"""

from __future__ import annotations

RERANK_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".'
    "<|im_end|>\n<|im_start|>user\n"
)
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_RERANK_INSTRUCTION = (
    "Given a web search query, retrieve relevant passages that answer the query"
)
# The markers of a pair formatted by its sender (module docstring).
_QUERY_MARKER = "<|im_start|>"
_DOCUMENT_MARKER = "<|im_start|>assistant"


def carries_template(query: str, document: str) -> bool:
    """Whether the sender already formatted this pair (vLLM's documented form)."""
    return query.lstrip().startswith(_QUERY_MARKER) or _DOCUMENT_MARKER in document


def rerank_prompt_parts(
    query: str, document: str, instruction: str | None = None
) -> tuple[str, str, str]:
    """The card's (prefix, body, suffix) for one raw pair; `instruction` None: the card's
    default."""
    body = (
        f"<Instruct>: {instruction or DEFAULT_RERANK_INSTRUCTION}\n"
        f"<Query>: {query}\n<Document>: {document}"
    )
    return RERANK_PREFIX, body, RERANK_SUFFIX


def format_rerank_pair(query: str, document: str, instruction: str | None = None) -> str:
    """The whole prompt of one raw (query, document) pair, to tokenize without special
    tokens."""
    return "".join(rerank_prompt_parts(query, document, instruction))


def rerank_token_ids(
    tokenizer: object, query: str, document: str, instruction: str | None = None
) -> list[int]:
    """The pair's token ids. Raw text: as the model card makes them, each part encoded on its
    own (the parts' boundaries are never merged into one token), without special tokens.
    Text that carries the template: the query's tokens, then the document's, as they are.
    Raises ValueError for an `instruction` beside such text (it would be silently unused)."""
    if carries_template(query, document):
        if instruction is not None:
            raise ValueError(
                "instruction is given, but the query and document already carry the "
                "reranker's template (which holds its own <Instruct>): leave one out"
            )
        parts: tuple[str, ...] = (query, document)
    else:
        parts = rerank_prompt_parts(query, document, instruction)
    encode = tokenizer.encode  # type: ignore[attr-defined]
    return [t for part in parts for t in encode(part, add_special_tokens=False)]


def truncate_document(tokenizer: object, document: str, max_tokens: int | None) -> str:
    """Cohere's `max_tokens_per_doc`: the document cut to its first `max_tokens` tokens (in
    the text, so that the template around it tokenizes as it would around any text)."""
    if max_tokens is None:
        return document
    ids = tokenizer.encode(document, add_special_tokens=False)  # type: ignore[attr-defined]
    if len(ids) <= max_tokens:
        return document
    return tokenizer.decode(ids[:max_tokens])  # type: ignore[attr-defined]
