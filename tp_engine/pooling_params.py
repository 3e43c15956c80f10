"""What a pooling request asks for instead of sampling: vLLM's `PoolingParams`.

A pooling request computes its prompt and ends: no token is sampled. Its head's row (the last
prompt token's) becomes one result on rank 0 (`tp_engine.core.pooled_records.finish_pooled`):

    task "embed"      the hidden state, cut to `dimensions` (Matryoshka) and then
                      L2-normalised when `normalize` (default: True, as vLLM's, unless
                      sentence-transformers modules without a Normalize module say raw)
    task "classify"   class probabilities: sigmoid for one label, softmax over several
                      (`use_activation=False`: the raw logits)
    task "score"      "classify" of a one-label model (a reranker's relevance)

`resolve(spec)` fills the defaults from the model and refuses what it cannot serve, with
vLLM's wording where vLLM has one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from rank_worker.models.model_spec import ModelSpec

PoolingTask = Literal["embed", "classify", "score"]
POOLING_TASKS = ("embed", "classify", "score")


@dataclass(frozen=True)
class PoolingParams:
    """A pooling request's parameters (module docstring); None = the model's default."""

    task: PoolingTask | None = None
    # embed: keep the first `dimensions` features, then renormalise (Matryoshka models only).
    dimensions: int | None = None
    # embed: L2-normalise the result.
    normalize: bool | None = None
    # classify / score: apply the sigmoid / softmax.
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {POOLING_TASKS}, got {self.task!r}")
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
        ):
            raise ValueError(f"dimensions must be an integer, got {self.dimensions!r}")

    def resolve(self, spec: ModelSpec) -> PoolingParams:
        """These params with every default filled in for the model of `spec`; ValueError for a
        task the model does not serve or `dimensions` it does not allow."""
        if not spec.is_pooling:
            raise ValueError(
                "pooling requests are only supported for pooling models; this model is served "
                "for generation. Try passing `runner='pooling'` (--runner pooling)"
            )
        model_task = spec.task  # "embed" or "classify"
        task = self.task or ("embed" if model_task == "embed" else "classify")
        if task == "embed" and model_task != "embed":
            raise ValueError(
                "Embedding API is not supported by this model. Try converting the model using "
                "`convert='embed'` (--convert embed)"
            )
        if task in ("classify", "score") and model_task != "classify":
            raise ValueError(
                f"{task.capitalize()} API is not supported by this model. Try converting the "
                "model using `convert='classify'` (--convert classify)"
            )
        if task == "score" and spec.head.num_scores != 1:
            raise ValueError(
                f"score needs a model with one label; this one has {spec.head.num_scores}"
            )
        if task != "embed" and (self.dimensions is not None or self.normalize is not None):
            raise ValueError(f"dimensions and normalize apply to embeddings, not to {task}")
        self._check_dimensions(spec)
        return dataclasses.replace(
            self,
            task=task,
            normalize=spec.normalize if self.normalize is None else self.normalize,
            use_activation=True if self.use_activation is None else self.use_activation,
        )

    def _check_dimensions(self, spec: ModelSpec) -> None:
        if self.dimensions is None:
            return
        if not spec.is_matryoshka:
            raise ValueError(
                "Model does not support Matryoshka embeddings; dimensions must be unset "
                f"(received dimensions={self.dimensions}). A Matryoshka model says so in its "
                "config (is_matryoshka or matryoshka_dimensions), or through "
                "hf_overrides={'is_matryoshka': true}"
            )
        listed = spec.matryoshka_dimensions
        if listed is not None and self.dimensions not in listed:
            raise ValueError(
                f"Model only supports {list(listed)} matryoshka dimensions (received "
                f"dimensions={self.dimensions}); other sizes give poor embeddings"
            )
        if not 1 <= self.dimensions <= spec.hidden_size:
            raise ValueError(
                f"Model only supports dimensions in range [1, {spec.hidden_size}] "
                f"(received dimensions={self.dimensions})"
            )
