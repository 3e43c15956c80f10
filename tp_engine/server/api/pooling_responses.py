"""Response bodies of the pooling routes, as vLLM shapes them (plain dicts, as `responses`).

Vectors arrive as float32 arrays (`pooling_batch`). An embedding goes out as a JSON list of
floats, or with `encoding_format` "base64" as the base64 of its little-endian float32 bytes,
which the official OpenAI client asks for by default and decodes with `np.frombuffer`.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from tp_engine.server.api.pooling_batch import POOLED_DTYPE
from tp_engine.server.api.responses import now_s


def usage(num_prompt_tokens: int) -> dict[str, int]:
    """Pooling computes no completion: every token is a prompt token."""
    return {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens}


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype(POOLED_DTYPE).tobytes()).decode("ascii")
    return vector.tolist()


def list_body(
    request_id: str, model: str, data: list[dict[str, Any]], num_prompt_tokens: int
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "list",
        "created": now_s(),
        "model": model,
        "data": data,
        "usage": usage(num_prompt_tokens),
    }


def embedding_data(
    vectors: list[np.ndarray], encoding_format: str, object_name: str = "embedding"
) -> list[dict[str, Any]]:
    """/v1/embeddings' items ("embedding"); /pooling's are "pooling" with the vector in
    `data`."""
    key = "embedding" if object_name == "embedding" else "data"
    return [
        {"index": i, "object": object_name, key: encode_vector(v, encoding_format)}
        for i, v in enumerate(vectors)
    ]


def classify_data(probs: list[np.ndarray], labels: list[str]) -> list[dict[str, Any]]:
    """One item per input: its class probabilities and the most likely class's name (the
    checkpoint's `labels`; vLLM's default names, LABEL_<i>, where it has none)."""
    return [
        {
            "index": i,
            "label": _label(int(np.argmax(p)), labels),
            "probs": p.tolist(),
            "num_classes": len(p),
        }
        for i, p in enumerate(probs)
    ]


def _label(index: int, labels: list[str]) -> str:
    return labels[index] if labels else f"LABEL_{index}"


def score_data(scores: list[float]) -> list[dict[str, Any]]:
    return [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]


def rerank_body(
    request_id: str,
    model: str,
    documents: list[str],
    scores: list[float],
    top_n: int | None,
    return_documents: bool,
    num_prompt_tokens: int,
) -> dict[str, Any]:
    """Jina's and Cohere's shape: the best documents first, cut to `top_n`, each with its
    position in the request."""
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)[:top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if return_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    return {"id": request_id, "model": model, "usage": usage(num_prompt_tokens), "results": results}


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The score of an embedding model: cosine of the two embeddings (in float64, so that a
    pair of unit vectors gives the same number however it was cut)."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return float(a64 @ b64 / (np.linalg.norm(a64) * np.linalg.norm(b64)))
