"""The K/V store shared by the backends that run on the project's kernels (triton, flash_attn).

`kernels.store_kv` skips negative slots on the device, so the padding rows of a CUDA-graph batch
cost no host sync; the torch backend stores with plain indexing instead.
"""

from __future__ import annotations

import torch

from kernels.store_kv import store_kv
from rank_worker.attention.backend import AttentionBackend


class KernelStoreBackend(AttentionBackend):
    """A backend whose `store_kv` is the project's Triton kernel; subclasses attend."""

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        store_kv(key, value, k_cache, v_cache, slot_mapping, kv_scales)
