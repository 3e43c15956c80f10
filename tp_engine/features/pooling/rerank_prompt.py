"""The Qwen3-Reranker prompt of its model card, in one place (`LLM.score` and the server's
`/score` and `/rerank` use it).

The reranker is a causal LM asked whether a document meets a query; its score is P("yes")
over {"no", "yes"} after this prompt. The model card builds it as prefix + body + suffix,
each part tokenized without special tokens; the body is

    <Instruct>: {instruction}\\n<Query>: {query}\\n<Document>: {document}

with single newlines (the README's transformers recipe; Qwen's vLLM example uses double ones,
which tokenize differently and score differently). Without the template a reranker scores raw
concatenations and ranks badly (vLLM #20478, Qwen3-Embedding #71).
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


def rerank_prompt_parts(
    query: str, document: str, instruction: str | None = None
) -> tuple[str, str, str]:
    """The card's (prefix, body, suffix) for one pair; `instruction` None: the card's
    default."""
    body = (
        f"<Instruct>: {instruction or DEFAULT_RERANK_INSTRUCTION}\n"
        f"<Query>: {query}\n<Document>: {document}"
    )
    return RERANK_PREFIX, body, RERANK_SUFFIX


def format_rerank_pair(query: str, document: str, instruction: str | None = None) -> str:
    """The whole prompt of one (query, document) pair, to tokenize without special tokens."""
    return "".join(rerank_prompt_parts(query, document, instruction))


def rerank_token_ids(
    tokenizer: object, query: str, document: str, instruction: str | None = None
) -> list[int]:
    """The pair's token ids as the model card makes them: each part encoded on its own (the
    parts' boundaries are never merged into one token), without special tokens."""
    return [
        t
        for part in rerank_prompt_parts(query, document, instruction)
        for t in tokenizer.encode(part, add_special_tokens=False)  # type: ignore[attr-defined]
    ]
