"""Parameters that know how to take their shard from a full checkpoint tensor.

A checkpoint stores each weight whole; every rank keeps only its part. Rather than teaching the
loader about every layer, each parameter carries a `weight_loader(param, full, shard_id)` set by
the layer that owns it: the layer knows how it is split. `shard_id` names the part of a packed
parameter (q/k/v of the fused QKV projection, 0/1 for gate/up) and is None otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

# (param, full checkpoint tensor, shard_id) -> None; copies this rank's shard into param.
WeightLoader = Callable[[nn.Parameter, torch.Tensor, Any], None]


def make_param(
    shape: tuple[int, ...],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    weight_loader: WeightLoader,
) -> nn.Parameter:
    """An uninitialised inference parameter with its loader attached.

    Uninitialised, because the loader overwrites every element (and fails if a weight is missing).
    """
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = weight_loader  # type: ignore[attr-defined]
    return param


def check_shape(full: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    """Reject a checkpoint tensor whose shape does not match the model config."""
    if tuple(full.shape) != tuple(expected):
        raise ValueError(
            f"{what}: checkpoint tensor has shape {tuple(full.shape)}, the config implies {expected}"
        )


def reject_shard_id(shard_id: object, what: str) -> None:
    if shard_id is not None:
        raise ValueError(f"{what} is not a packed parameter, got shard_id {shard_id!r}")


def replicated_weight_loader(param: nn.Parameter, full: torch.Tensor, shard_id: Any = None) -> None:
    """Every rank keeps the whole tensor (norm weights, biases of row-parallel layers)."""
    reject_shard_id(shard_id, "a replicated parameter")
    check_shape(full, tuple(param.shape), "replicated parameter")
    param.data.copy_(full)  # copy_ converts the checkpoint dtype to the parameter dtype


class CheckpointPart(NamedTuple):
    """Where one checkpoint tensor goes: parameter `param` (relative to the module that names
    it), part `shard_id` of it. `param` None: a tensor the checkpoint must contain but this rank
    does not keep (an expert another rank holds under expert parallelism); the loader checks
    its presence and `shape` from the file header without reading its data. `optional`: a
    checkpoint may leave it out and the parameter keeps its initial value (an FP8 KV cache's
    `k_scale`/`v_scale`, 1.0 unless given)."""

    param: str | None
    shard_id: Any = None
    shape: tuple[int, ...] | None = None
    optional: bool = False
