"""What `LLM.encode`, `embed`, `classify` and `score` return: vLLM's output shapes.

Each request output holds its `request_id`, `prompt_token_ids`, `finished` and `outputs`, whose
type says what the request was: `PoolingOutput.data` (the raw result tensor), or the task's
view of it, `EmbeddingOutput.embedding`, `ClassificationOutput.probs`, `ScoringOutput.score`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


@dataclass
class PoolingOutput:
    """A pooling request's result (float32, on the host)."""

    data: torch.Tensor


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput(Generic[T]):
    request_id: str
    outputs: T
    prompt_token_ids: list[int]
    finished: bool = True


EmbeddingRequestOutput = PoolingRequestOutput[EmbeddingOutput]
ClassificationRequestOutput = PoolingRequestOutput[ClassificationOutput]
ScoringRequestOutput = PoolingRequestOutput[ScoringOutput]
