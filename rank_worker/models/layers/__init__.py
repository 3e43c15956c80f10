"""Tensor-parallel building blocks of the Qwen3 and Qwen3-MoE models.

Each layer takes a `TPInfo` in its constructor, states in its docstring how its weight is split
over ranks and which collective its forward issues, and gives each parameter a `weight_loader`
that cuts this rank's shard out of the full checkpoint tensor.
"""

from rank_worker.models.layers.activation import SiluAndMul
from rank_worker.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from rank_worker.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from rank_worker.models.layers.moe import ExpertPlacement, FusedMoE, Qwen3MoeSparseBlock, TopKRouter
from rank_worker.models.layers.norm import RMSNorm
from rank_worker.models.layers.rope_spec import RopeSpec
from rank_worker.models.layers.rotary import RotaryEmbedding

__all__ = [
    "ColumnParallelLinear",
    "ExpertPlacement",
    "FusedMoE",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "Qwen3MoeSparseBlock",
    "RMSNorm",
    "RopeSpec",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "TopKRouter",
    "VocabParallelEmbedding",
]
