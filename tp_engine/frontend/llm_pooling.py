"""`LLM`'s pooling methods, vLLM's offline API for embedding and reranker models.

    encode(prompts, pooling_params)    -> [PoolingRequestOutput]   the raw result tensors
    embed(prompts, pooling_params)     -> [EmbeddingRequestOutput]  .outputs.embedding
    classify(prompts)                  -> [ClassificationRequestOutput]  .outputs.probs
    score(text_1, text_2)              -> [ScoringRequestOutput]  .outputs.score

A prompt is what `generate` takes (text, token ids, or a dict). Text is tokenized with the
tokenizer's special tokens, so Qwen3-Embedding's tokenizer appends its `<|endoftext|>`; token
ids are used as given (without it the vectors differ, as in vLLM). Each method refuses a model
served for another task with vLLM's message (`PoolingParams.resolve`).

`score` pairs one text with many (1 -> N), or N with N. On an embedding model a score is the
cosine of the two embeddings; on a classifier with one label (a reranker) it is that label's
probability for the pair, formatted with the Qwen3-Reranker prompt of the model card
(`tp_engine.features.pooling.rerank_prompt`, with `instruction`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.nn.functional as F

from tp_engine.features.pooling.rerank_prompt import rerank_token_ids
from tp_engine.frontend.per_prompt import per_prompt
from tp_engine.frontend.pooling_outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from tp_engine.pooling_params import PoolingParams, PoolingTask

if TYPE_CHECKING:
    from tp_engine.engine import LLMEngine

T = TypeVar("T")


class PoolingMethods:
    """Mixed into `LLM`; reads its engine, tokenizer and request ids, and runs requests with
    its `_run_pooling`."""

    engine: LLMEngine
    tokenizer: Any
    _ids: itertools.count
    # `LLM`'s: the prompts as token id lists, and running pooling requests to their results.
    _prompt_id_lists: Callable[[Any], list[list[int]]]
    _run_pooling: Callable[
        [list[list[int]], list[PoolingParams], bool], list[tuple[str, torch.Tensor]]
    ]

    def encode(
        self,
        prompts: Any,
        pooling_params: PoolingParams | SequenceOf[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """Pool every prompt (the model's task unless the params name one); results in the
        order of `prompts`."""
        ids = self._prompt_id_lists(prompts)
        params = per_prompt(
            pooling_params, PoolingParams, len(ids), "pooling params", PoolingParams()
        )
        results = self._run_pooling(ids, params, use_tqdm)
        return [
            PoolingRequestOutput(request_id, PoolingOutput(data), token_ids)
            for (request_id, data), token_ids in zip(results, ids, strict=True)
        ]

    def embed(
        self,
        prompts: Any,
        pooling_params: PoolingParams | SequenceOf[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Embeddings of `prompts` (`PoolingParams(dimensions=d)` for a Matryoshka cut)."""
        params = _with_task(pooling_params, "embed")
        outs = self.encode(prompts, params, use_tqdm)
        return [_viewed(o, EmbeddingOutput(o.outputs.data.tolist())) for o in outs]

    def classify(
        self,
        prompts: Any,
        pooling_params: PoolingParams | SequenceOf[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities of `prompts` (sigmoid for one label, else softmax)."""
        params = _with_task(pooling_params, "classify")
        outs = self.encode(prompts, params, use_tqdm)
        return [_viewed(o, ClassificationOutput(o.outputs.data.tolist())) for o in outs]

    def score(
        self,
        text_1: str | SequenceOf[str],
        text_2: str | SequenceOf[str],
        *,
        instruction: str | None = None,
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """The score of each pair (module docstring): `text_1` one text or as many as
        `text_2`; `instruction` (rerankers): the task the query is for, None for the card's
        default."""
        firsts, seconds = _pairs(text_1, text_2)
        if self.engine.model_spec.task == "embed":
            return self._cosine_scores(firsts, seconds, use_tqdm)
        ids = [
            rerank_token_ids(self.tokenizer, q, d, instruction)
            for q, d in zip(firsts, seconds, strict=True)
        ]
        params = [PoolingParams(task="score")] * len(ids)
        results = self._run_pooling(ids, params, use_tqdm)
        return [
            PoolingRequestOutput(request_id, ScoringOutput(float(data[0])), token_ids)
            for (request_id, data), token_ids in zip(results, ids, strict=True)
        ]

    def _cosine_scores(
        self, firsts: list[str], seconds: list[str], use_tqdm: bool
    ) -> list[ScoringRequestOutput]:
        distinct = list(dict.fromkeys(firsts + seconds))  # each text embedded once
        outs = self.encode(distinct, PoolingParams(task="embed"), use_tqdm)
        vectors = {text: o.outputs.data for text, o in zip(distinct, outs, strict=True)}
        token_ids = {text: o.prompt_token_ids for text, o in zip(distinct, outs, strict=True)}
        return [
            PoolingRequestOutput(
                f"score-{next(self._ids)}",
                ScoringOutput(F.cosine_similarity(vectors[a], vectors[b], dim=0).item()),
                token_ids[a] + token_ids[b],
            )
            for a, b in zip(firsts, seconds, strict=True)
        ]


def _viewed(out: PoolingRequestOutput[PoolingOutput], view: T) -> PoolingRequestOutput[T]:
    """`out` with its result shown as a task's output type."""
    return PoolingRequestOutput(out.request_id, view, out.prompt_token_ids, out.finished)


def _with_task(
    params: PoolingParams | SequenceOf[PoolingParams] | None, task: PoolingTask
) -> list[PoolingParams] | PoolingParams:
    """The params with `task` set (a task given for another method is an error)."""
    if params is None:
        return PoolingParams(task=task)
    many = [params] if isinstance(params, PoolingParams) else list(params)
    for p in many:
        if p.task not in (None, task):
            raise ValueError(f"pooling params for task {p.task!r} given to {task}()")
    out = [dataclasses.replace(p, task=task) for p in many]
    return out[0] if isinstance(params, PoolingParams) else out


def _pairs(
    text_1: str | SequenceOf[str], text_2: str | SequenceOf[str]
) -> tuple[list[str], list[str]]:
    """vLLM's pairing: 1 -> 1, 1 -> N (the first text with each second), or N -> N."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if not firsts or not seconds:
        raise ValueError("score needs at least one text on each side")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ValueError(
            f"score pairs 1 text with N, or N with N; got {len(firsts)} and {len(seconds)}"
        )
    return firsts, seconds
