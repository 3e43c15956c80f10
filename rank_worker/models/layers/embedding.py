"""Vocabulary-parallel token embedding and LM head.

Both split the vocabulary rows: rank r owns token ids `[r * V_local, (r+1) * V_local)` where
`V_local = ceil(V / size)`. When V is not a multiple of the TP size the last rank's table is
padded with zero rows; no real token id maps to them, and the logits they produce are cut off
after the gather. A tied LM head reuses the embedding's parameter, so the shard layout is the
same by construction.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rank_worker.models.layers.params import check_shape, make_param, reject_shard_id
from rank_worker.tp import TPInfo, all_reduce, gather_to_first


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over ranks.

    Split: rank r holds rows `[r * V_local, (r+1) * V_local)` of the `[V, hidden]` table,
    zero-padded past V. Forward: each rank embeds the ids it owns (zeros for the others), then one
    all-reduce (sum) assembles the full `[num_tokens, hidden]` embeddings on every rank.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp: TPInfo,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        shared_weight: nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_local_embeddings = math.ceil(num_embeddings / tp.size)
        self.padded_num_embeddings = self.num_local_embeddings * tp.size
        self.vocab_start = tp.rank * self.num_local_embeddings
        self.vocab_end = self.vocab_start + self.num_local_embeddings
        if shared_weight is not None:
            # Tied: reuse another table with the same shard layout instead of allocating one.
            self.weight = shared_weight
        else:
            self.weight = make_param(
                (self.num_local_embeddings, embedding_dim),
                dtype=dtype,
                device=device,
                weight_loader=self._load_rows,
            )

    def _load_rows(self, param: nn.Parameter, full: torch.Tensor, shard_id: Any = None) -> None:
        reject_shard_id(shard_id, type(self).__name__)
        check_shape(full, (self.num_embeddings, self.embedding_dim), type(self).__name__)
        real_rows = max(0, min(self.vocab_end, self.num_embeddings) - self.vocab_start)
        param.data[:real_rows].copy_(full.narrow(0, self.vocab_start, real_rows))
        param.data[real_rows:].zero_()  # padding rows past the real vocabulary

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.is_single:
            return F.embedding(input_ids, self.weight)  # [num_tokens, hidden]
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)  # [num_tokens]
        # Ids owned by other ranks look up row 0 and are zeroed, so the sum over ranks picks
        # exactly one real row per token.
        local_ids = torch.where(owned, input_ids - self.vocab_start, 0)
        emb = F.embedding(local_ids, self.weight)  # [num_tokens, hidden]
        emb = emb * owned.unsqueeze(-1).to(emb.dtype)
        return all_reduce(emb, self.tp)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection `hidden -> logits` with the vocabulary split over ranks.

    Split: as `VocabParallelEmbedding` (rank r owns the logits of its token ids). Tied: `tie_to`
    makes it share the embedding's parameter, so nothing extra is loaded or stored.
    Forward (`compute_logits`): each rank computes `[B', V_local]`, then one gather to rank 0
    (`gather_to_first`), which drops the padding columns and returns `[B', V]` fp32; the other
    ranks return None.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp: TPInfo,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        tie_to: VocabParallelEmbedding | None = None,
    ) -> None:
        if tie_to is not None and (tie_to.num_embeddings, tie_to.embedding_dim) != (
            num_embeddings,
            embedding_dim,
        ):
            raise ValueError("a tied LM head must have the embedding's shape")
        super().__init__(
            num_embeddings,
            embedding_dim,
            tp,
            dtype=dtype,
            device=device,
            shared_weight=None if tie_to is None else tie_to.weight,
        )
        self.tied = tie_to is not None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """`hidden [B', hidden]` -> logits `[B', V]` fp32 on rank 0, None on other ranks."""
        local = F.linear(hidden, self.weight)  # [B', V_local]
        full = gather_to_first(local, self.tp, dim=-1)  # [B', V_local * size] on rank 0
        if full is None:
            return None
        return full[:, : self.num_embeddings].to(torch.float32).contiguous()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        return self.compute_logits(hidden)
