"""The output heads a Qwen3 body can end in, one chosen per model at build time (`HeadSpec`).

Every head maps the final-norm hidden states of the rows a step asks for (`[R, hidden]`, whole
on every rank) to `[R, width]` fp32 on rank 0 and None on the other ranks. Every rank calls it
with the same rows; a head's collectives (if any) then match.

| head              | width       | collective          | what a row holds                        |
|-------------------|-------------|---------------------|-----------------------------------------|
| `LMHead`          | vocab       | gather to rank 0    | next-token logits (sampled on rank 0)   |
| `LastTokenHead`   | hidden      | none                | the hidden state itself (an embedding)  |
| `TokenScoreHead`  | 1           | the LM head's       | logit(true token) - logit(false token)  |
| `ClassifierHead`  | num_labels  | none                | `score.weight @ hidden` (class logits)  |

Activations (normalisation, sigmoid, softmax, Matryoshka cuts) are per request and stay on
rank 0 (`tp_engine.core.pooled_records`); the heads return raw numbers.
"""

from __future__ import annotations

import torch
from torch import nn

from rank_worker.models.layers import ParallelLMHead
from rank_worker.tp import TPInfo


class LMHead:
    """Today's head: the vocab-parallel LM head, logits gathered to rank 0."""

    def __init__(self, lm_head: ParallelLMHead) -> None:
        self.lm_head = lm_head
        self.width = lm_head.num_embeddings

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head.compute_logits(hidden)  # [R, vocab] fp32 on rank 0


class LastTokenHead:
    """Qwen3-Embedding: the final-norm hidden state of each pooled row (its prompt's last
    token) in fp32. The hidden state is whole on every rank, so rank 0 needs no collective."""

    def __init__(self, hidden_size: int, tp: TPInfo) -> None:
        self.width = hidden_size
        self.tp = tp

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if not self.tp.is_first:
            return None
        return hidden.to(torch.float32)  # [R, hidden]


class TokenScoreHead:
    """The original Qwen3-Reranker, a causal LM: its relevance is P("yes") over {"no", "yes"}
    at the last position, i.e. sigmoid(logit_yes - logit_no). The LM head is the one the
    checkpoint has (tied to the embedding or not), loaded as for generation, so every form of
    the checkpoint works without a conversion step (vLLM #27857 scored 0.5 everywhere when an
    untied head was not loaded); its full rows are gathered and two columns kept: for one row
    per request the gather is small next to the forward."""

    def __init__(self, lm_head: ParallelLMHead, token_ids: tuple[int, int]) -> None:
        self.lm_head = lm_head
        self.false_id, self.true_id = token_ids
        self.width = 1
        for tid in token_ids:
            if not 0 <= tid < lm_head.num_embeddings:
                raise ValueError(f"classifier token id {tid} is outside the vocabulary")

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head.compute_logits(hidden)  # [R, vocab] fp32 on rank 0
        if logits is None:
            return None
        return (
            logits[:, self.true_id : self.true_id + 1]
            - logits[:, self.false_id : self.false_id + 1]
        )


class ClassifierWeight(nn.Module):
    """`score.weight [num_labels, hidden]` of a `*ForSequenceClassification` checkpoint,
    whole on every rank (a few rows: splitting it would cost a collective for nothing)."""

    def __init__(
        self, num_labels: int, hidden_size: int, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_labels, hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.weight.weight_loader = _load_whole  # type: ignore[attr-defined]


def _load_whole(param: nn.Parameter, full: torch.Tensor, shard_id: object = None) -> None:
    if tuple(full.shape) != tuple(param.shape):
        raise ValueError(f"shape {tuple(full.shape)}, the model expects {tuple(param.shape)}")
    param.data.copy_(full)


class ClassifierHead:
    """A converted reranker or classifier: class logits `hidden @ score.weight.T` in fp32 on
    rank 0 (vLLM's classify pooler before its activation)."""

    def __init__(self, score: ClassifierWeight, tp: TPInfo) -> None:
        self.score = score
        self.width = score.weight.shape[0]
        self.tp = tp

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if not self.tp.is_first:
            return None
        return hidden.to(torch.float32) @ self.score.weight.to(torch.float32).T  # [R, labels]


Head = LMHead | LastTokenHead | TokenScoreHead | ClassifierHead
