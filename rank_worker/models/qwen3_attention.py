"""Qwen3's self-attention on one tensor-parallel shard: what every decoder layer of
`rank_worker.models.qwen3` (and of Qwen3-MoE) runs before its MLP.

QKV column-parallel projection → per-head q/k RMSNorm → rotary embedding → paged attention →
o_proj row-parallel (one all-reduce). The fused path (Triton kernels) normalises and rotates q
and k in place, and stores the step's K/V too where the backend stores with the project's
kernel (`_stores_with_the_kernel`); the plain torch path is the reference. Also here: the
layout of one layer's cache (`KVCachePair`) and the optional fp8 KV-cache scales.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rank_worker.attention.backend import AttentionBackend
from rank_worker.attention.metadata import AttentionMetadata
from rank_worker.models.layers import QKVParallelLinear, RMSNorm, RotaryEmbedding, RowParallelLinear
from rank_worker.models.layers.params import CheckpointPart
from rank_worker.models.quantization import fp8_quant_of
from rank_worker.tp import TPInfo

# One layer's K and V caches, each [num_blocks, block_size, num_local_kv_heads, head_dim].
KVCachePair = tuple[torch.Tensor, torch.Tensor]


def head_dim_of(hf_config: Any) -> int:
    """Qwen3 configs state head_dim (it is not hidden / heads for every size)."""
    return (
        getattr(hf_config, "head_dim", None)
        or hf_config.hidden_size // hf_config.num_attention_heads
    )


class Qwen3Attention(nn.Module):
    """Self-attention of one layer on this rank's heads; one all-reduce (in o_proj).

    `kv_scales [2]` fp32 `(k_scale, v_scale)`: how an fp8 KV cache stores this layer's K and V
    (`K / k_scale`, e4m3). 1.0 unless the checkpoint gives `self_attn.k_scale` /
    `self_attn.v_scale` (optional tensors); unused by a cache in the model dtype.
    """

    def __init__(
        self,
        hf_config: Any,
        tp: TPInfo,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        fused: bool = False,
    ) -> None:
        super().__init__()
        head_dim = head_dim_of(hf_config)
        bias = bool(getattr(hf_config, "attention_bias", False))
        quant = fp8_quant_of(hf_config, fused)
        eps = hf_config.rms_norm_eps
        self.eps = eps
        self.fused = fused
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.qkv_proj = QKVParallelLinear(
            hf_config.hidden_size,
            head_dim,
            hf_config.num_attention_heads,
            hf_config.num_key_value_heads,
            tp,
            bias=bias,
            dtype=dtype,
            device=device,
            quant=quant,
        )
        self.num_local_heads = self.qkv_proj.num_local_heads
        self.num_local_kv_heads = self.qkv_proj.num_local_kv_heads
        self.o_proj = RowParallelLinear(
            hf_config.num_attention_heads * head_dim,
            hf_config.hidden_size,
            tp,
            bias=bias,
            dtype=dtype,
            device=device,
            quant=quant,
        )
        self.q_norm = RMSNorm(head_dim, eps, dtype=dtype, device=device)
        self.k_norm = RMSNorm(head_dim, eps, dtype=dtype, device=device)
        self.rotary = rotary  # shared by all layers: one cos/sin table per model
        self.backend = backend
        self.kv_scales = nn.Parameter(
            torch.ones(2, dtype=torch.float32, device=device), requires_grad=False
        )
        self.kv_scales.weight_loader = _load_kv_scale  # type: ignore[attr-defined]
        # What `forward` reads of its submodules and parameters, in plain attributes: each
        # `self.<submodule>` or `self.<parameter>` read goes through nn.Module.__getattr__
        # (about a microsecond or two), ten per layer per eager step otherwise. The objects
        # stay these for the module's life: loads, updates and sleep write into them in place.
        # The projections are called through `forward`, as the blocks of a decoder layer
        # (`rank_worker.models.qwen3`: no hooks inside a layer).
        self.q_size = self.qkv_proj.q_size
        self._projections = (self.qkv_proj.forward, self.o_proj.forward)
        self._kernel_params = (self.q_norm.weight, self.k_norm.weight, self.kv_scales)
        # Whether the q/k kernel also stores the step's K/V (one launch fewer per layer).
        self.fused_kv_store = fused and _stores_with_the_kernel(backend)
        if fused:
            from kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_store_kv

            self._qk_norm_rope = qk_norm_rope
            self._qk_norm_rope_store_kv = qk_norm_rope_store_kv

    def checkpoint_parts(self) -> dict[str, CheckpointPart]:
        """The optional KV-cache scales; the projections and norms load by their names."""
        return {
            "k_scale": CheckpointPart("kv_scales", 0, optional=True),
            "v_scale": CheckpointPart("kv_scales", 1, optional=True),
        }

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCachePair,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv_proj, o_proj = self._projections
        qkv = qkv_proj(hidden)  # [T, (heads + 2 * kv_heads) * head_dim], local heads
        q_weight, k_weight, kv_scales = self._kernel_params
        if self.fused_kv_store and not self._attends_fresh_kv(qkv, kv_cache, meta):
            # q and k normalised and rotated in place, K and V stored in the cache, one launch;
            # then attention over the cache alone (the store is done).
            k_cache, v_cache = kv_cache
            self._qk_norm_rope_store_kv(
                qkv, positions, q_weight, k_weight, self.rotary.cos_sin_cache, k_cache,
                v_cache, meta.slot_mapping, self.num_local_heads, self.num_local_kv_heads,
                self.head_dim, self.eps, kv_scales,
            )  # fmt: skip
            # The q heads of each row as [T, heads, head_dim]: one view op where a slice and a
            # view are two (the kernel above checked that qkv's last dim is dense).
            d = self.head_dim
            q = qkv.as_strided((num_tokens, self.num_local_heads, d), (qkv.stride(0), d, 1))
            o = self.backend.attend(q, k_cache, v_cache, meta, self.scale, kv_scales)
            return o_proj(o.reshape(num_tokens, -1))  # [T, hidden], all-reduced
        if self.fused:
            # q and k normalised and rotated in place; attention reads them as strided views.
            self._qk_norm_rope(
                qkv, positions, q_weight, k_weight, self.rotary.cos_sin_cache,
                self.num_local_heads, self.num_local_kv_heads, self.head_dim, self.eps,
            )  # fmt: skip
        q, k, v = self._qkv_views(qkv)
        if not self.fused:
            q, k = self.rotary(positions, self.q_norm(q), self.k_norm(k))
        # [T, heads, head_dim]
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, kv_scales)
        return o_proj(o.reshape(num_tokens, -1))  # [T, hidden], all-reduced

    def _qkv_views(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, d], k and v [T, kv_heads, d]: views of the QKV projection's rows."""
        num_tokens = qkv.shape[0]
        kv_size = self.num_local_kv_heads * self.head_dim
        q, k, v = qkv.split([self.q_size, kv_size, kv_size], -1)
        return (
            q.view(num_tokens, self.num_local_heads, self.head_dim),
            k.view(num_tokens, self.num_local_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_local_kv_heads, self.head_dim),
        )

    def _attends_fresh_kv(
        self, qkv: torch.Tensor, kv_cache: KVCachePair, meta: AttentionMetadata
    ) -> bool:
        """Whether the backend attends this step from its own K/V (`reads_fresh_kv`): asked
        only on steps with fresh prompts, so a decode step pays two attribute reads, and with
        this layer's views only if the step's answer may be yes (`may_attend_fresh_kv`)."""
        if not (meta.fresh_prefill and self.backend.reads_fresh_kv):
            return False
        if not self.backend.may_attend_fresh_kv(qkv.dtype, self.head_dim, kv_cache[0], meta):
            return False
        q, k, v = self._qkv_views(qkv)
        return self.backend.attends_fresh_kv(q, k, v, kv_cache[0], meta)


def _stores_with_the_kernel(backend: AttentionBackend) -> bool:
    """Whether `backend` stores K/V with `kernels.store_kv` and attends after it, nothing more:
    then `qk_norm_rope_store_kv` may do its store (the cache ends up bit for bit the same) and
    the layer calls `attend` alone. A backend that stores otherwise (the torch backend's
    indexing) or wraps `forward` keeps its own store; one whose `forward` differs only on
    fresh prompts (`reads_fresh_kv`) gets `forward` on the steps it says it attends from the
    step's own K/V (`attends_fresh_kv`)."""
    from rank_worker.attention.backend import AttentionBackend as Base
    from rank_worker.attention.kernel_store import KernelStoreBackend

    cls = type(backend)
    # The class whose `forward` runs: the base's, or one that says it differs only there.
    owner = next(c for c in cls.__mro__ if "forward" in vars(c))
    plain_forward = owner is Base or vars(owner).get("reads_fresh_kv", False)
    return cls.store_kv is KernelStoreBackend.store_kv and plain_forward


def _load_kv_scale(param: nn.Parameter, full: torch.Tensor, shard_id: int) -> None:
    """A checkpoint's `k_scale` (shard 0) or `v_scale` (1): one positive number."""
    if full.numel() != 1:
        raise ValueError(f"a KV-cache scale must hold one number, got shape {tuple(full.shape)}")
    if full.is_meta:  # a check without values (`WeightMap.check`): the shape is all there is
        return
    value = float(full.reshape(()).float())
    if not (value > 0.0 and value < float("inf")):
        raise ValueError(f"a KV-cache scale must be positive and finite, got {value}")
    param.data[shard_id] = value
