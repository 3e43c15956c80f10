"""Rank 0's last step of a pooling request: its head row becomes its result.

The head (`rank_worker.models.heads`) returns raw rows in fp32; what a request asked for
(`PoolingParams`, resolved) is applied here, per request, on the host copy:

    embed      row[:dimensions], then L2-normalised when `normalize` (vLLM's order: a
               Matryoshka cut is renormalised, sentence-transformers' `truncate_dim` with
               `normalize_embeddings=True`)
    classify   sigmoid of a single logit (a reranker's relevance) or softmax over the labels,
    / score    unless `use_activation` is False
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tp_engine.core.plan_builder import PooledRow
from tp_engine.core.sequence import SequenceStatus
from tp_engine.pooling_params import PoolingParams


def finish_pooled(row: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """`row [width]` fp32 -> the request's result, fp32 (module docstring)."""
    if params.task == "embed":
        if params.dimensions is not None:
            row = row[: params.dimensions]
        return F.normalize(row, dim=-1) if params.normalize else row.clone()
    if not params.use_activation:
        return row.clone()
    return torch.sigmoid(row) if row.numel() == 1 else torch.softmax(row, dim=-1)


def record_pooled(rows: torch.Tensor, found: list[PooledRow]) -> None:
    """`rows [P, width]` on the host, in the order of `found`: each sequence's result. A
    sequence preempted or aborted since the step was scheduled (asynchronous scheduling) gets
    none: the scheduler discards the step's work for it, and its output must not carry one."""
    for pooled, row in zip(found, rows, strict=True):
        if pooled.seq.status is not SequenceStatus.RUNNING:
            continue
        params = pooled.seq.pooling_params
        assert params is not None
        pooled.seq.pooled = finish_pooled(row, params)
