"""The Qwen3 dense model, one tensor-parallel shard of it per rank.

Per decoder layer: RMSNorm (fused with the residual add) → QKV column-parallel projection →
per-head q/k RMSNorm → rotary embedding → paged attention → o_proj row-parallel (all-reduce) →
RMSNorm (fused residual add) → gate/up merged column-parallel → SiLU×mul → down_proj
row-parallel (all-reduce). Then the final norm and the head chosen at build time
(`rank_worker.models.heads`): for generation the vocab-parallel LM head, whose logits are gathered to
rank 0. So a forward pass issues 1 + 2 * num_layers all-reduces and one gather (none for an
embedding or seq-cls head).

Two implementations of the non-matmul ops, chosen per model (`fused`):
- fused (Triton kernels, GPU, or CPU under the interpreter): add+RMSNorm, SiLU·mul, and the
  q/k norm with the rotary embedding as one in-place kernel over the QKV output
  (`kernels.qk_norm_rope`), which also stores the step's K/V in the cache when the backend
  would store them with the project's store kernel (triton, flash_attn); attention then reads
  q as a view and K/V from the cache. A decode step launches about nine operations per layer:
  2 norms, 4 matmuls, q/k norm+rotary+K/V store, attention (plus its split merge), SiLU·mul;
  and the all-reduces when TP > 1;
- plain torch: the reference, and the CPU path (about 60 eager ops per layer).

Parameter names mirror the Hugging Face checkpoint names, except where several checkpoint
tensors are packed into one parameter (`packed_modules_mapping`), so the loader can map names
without a table per model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from rank_worker.attention.backend import AttentionBackend
from rank_worker.attention.metadata import AttentionMetadata
from rank_worker.attention.selection import get_backend
from rank_worker.models.heads import (
    ClassifierHead,
    ClassifierWeight,
    Head,
    LastTokenHead,
    LMHead,
    TokenScoreHead,
)
from rank_worker.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RopeSpec,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
)
from rank_worker.models.layers.params import CheckpointPart
from rank_worker.models.model_spec import HeadSpec
from rank_worker.models.quantization import fp8_quant_of
from rank_worker.tp import TPInfo

# One layer's K and V caches, each [num_blocks, block_size, num_local_kv_heads, head_dim].
KVCachePair = tuple[torch.Tensor, torch.Tensor]
# layer index -> that layer's MLP (`[T, hidden] -> [T, hidden]`, all-reduced), for models whose
# layers differ there (Qwen3-MoE's sparse and dense layers); None: Qwen3's dense MLP everywhere.
MLPFactory = Callable[[int], nn.Module]


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
        qkv = self.qkv_proj(hidden)  # [T, (heads + 2 * kv_heads) * head_dim], local heads
        if self.fused_kv_store and not self._attends_fresh_kv(qkv, kv_cache, meta):
            # q and k normalised and rotated in place, K and V stored in the cache, one launch;
            # then attention over the cache alone (the store is done).
            k_cache, v_cache = kv_cache
            self._qk_norm_rope_store_kv(
                qkv, positions, self.q_norm.weight, self.k_norm.weight,
                self.rotary.cos_sin_cache, k_cache, v_cache, meta.slot_mapping,
                self.num_local_heads, self.num_local_kv_heads, self.head_dim, self.eps,
                self.kv_scales,
            )  # fmt: skip
            q = qkv[:, : self.qkv_proj.q_size].view(num_tokens, self.num_local_heads, self.head_dim)
            o = self.backend.attend(q, k_cache, v_cache, meta, self.scale, self.kv_scales)
            return self.o_proj(o.reshape(num_tokens, -1))  # [T, hidden], all-reduced
        if self.fused:
            # q and k normalised and rotated in place; attention reads them as strided views.
            self._qk_norm_rope(
                qkv, positions, self.q_norm.weight, self.k_norm.weight,
                self.rotary.cos_sin_cache, self.num_local_heads, self.num_local_kv_heads,
                self.head_dim, self.eps,
            )  # fmt: skip
        q, k, v = self._qkv_views(qkv)
        if not self.fused:
            q, k = self.rotary(positions, self.q_norm(q), self.k_norm(k))
        # [T, heads, head_dim]
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, self.kv_scales)
        return self.o_proj(o.reshape(num_tokens, -1))  # [T, hidden], all-reduced

    def _qkv_views(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, d], k and v [T, kv_heads, d]: views of the QKV projection's rows."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split(
            [self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], -1
        )
        return (
            q.view(num_tokens, self.num_local_heads, self.head_dim),
            k.view(num_tokens, self.num_local_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_local_kv_heads, self.head_dim),
        )

    def _attends_fresh_kv(
        self, qkv: torch.Tensor, kv_cache: KVCachePair, meta: AttentionMetadata
    ) -> bool:
        """Whether the backend attends this step from its own K/V (`reads_fresh_kv`): asked
        only on steps with fresh prompts, so a decode step pays two attribute reads."""
        if not (meta.fresh_prefill and self.backend.reads_fresh_kv):
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


class Qwen3MLP(nn.Module):
    """SwiGLU MLP on this rank's slice of the intermediate features; one all-reduce."""

    def __init__(
        self,
        hf_config: Any,
        tp: TPInfo,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        fused: bool = False,
    ) -> None:
        super().__init__()
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported (only silu)")
        inter = hf_config.intermediate_size
        quant = fp8_quant_of(hf_config, fused)
        self.gate_up_proj = MergedColumnParallelLinear(
            hf_config.hidden_size, [inter, inter], tp, dtype=dtype, device=device, quant=quant
        )
        self.act = SiluAndMul(fused=fused)
        self.down_proj = RowParallelLinear(
            inter, hf_config.hidden_size, tp, dtype=dtype, device=device, quant=quant
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))  # [T, hidden], all-reduced


class Qwen3DecoderLayer(nn.Module):
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
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        eps = hf_config.rms_norm_eps
        kw = dict(dtype=dtype, device=device, fused=fused)
        self.self_attn = Qwen3Attention(hf_config, tp, rotary, backend, **kw)
        self.mlp = mlp if mlp is not None else Qwen3MLP(hf_config, tp, **kw)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps, **kw)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps, **kw)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        kv_cache: KVCachePair,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns `(block output, residual stream)`; the next norm adds them (fused)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta, kv_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3Model(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        tp: TPInfo,
        backend: AttentionBackend,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        fused: bool = False,
        mlp_factory: MLPFactory | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            hf_config.vocab_size, hf_config.hidden_size, tp, dtype=dtype, device=device
        )
        rotary = RotaryEmbedding(RopeSpec.from_config(hf_config), device=device)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(
                hf_config,
                tp,
                rotary,
                backend,
                dtype=dtype,
                device=device,
                fused=fused,
                mlp=None if mlp_factory is None else mlp_factory(i),
            )
            for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(
            hf_config.hidden_size, hf_config.rms_norm_eps, dtype=dtype, device=device, fused=fused
        )
        # EAGLE-3 (`rank_worker.spec.eagle3_runner`): the residual streams a forward keeps, as
        # indices of Hugging Face's `output_hidden_states` (i: the input of layer i); empty:
        # none. `captured` then holds `(embeddings [T, hidden], states [T, len * hidden])`.
        self.capture_layers: tuple[int, ...] = ()
        self.captured: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCachePair],
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        wanted = self.capture_layers
        # A clone: the fused add+norm of layer 1 updates the residual (this tensor) in place.
        states = {0: hidden.clone()} if wanted else {}
        residual: torch.Tensor | None = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if i in wanted and i > 0:
                states[i] = hidden + residual  # the input of layer i, before its norm
            hidden, residual = layer(positions, hidden, residual, meta, kv_cache)
        if len(self.layers) in wanted:
            states[len(self.layers)] = hidden + residual
        if wanted:
            self.captured = (states[0], torch.cat([states[i] for i in wanted], dim=-1))
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3ForCausalLM(nn.Module):
    """This rank's shard of a Qwen3 causal LM.

    `forward(input_ids [T], positions [T], attn_metadata, kv_caches)` -> normed hidden states
    `[T, hidden]` (whole on every rank); `compute_logits(hidden [B', hidden])` -> logits
    `[B', vocab]` fp32 on rank 0, None on the other ranks. Every rank must call both with the
    same shapes, since both issue collectives. `fused_kernels`: the Triton kernels for the
    non-matmul ops (see the module docstring); the caller checks that they can run here.
    `mlp_factory`: each layer's MLP, for models built on this one (`rank_worker.models.qwen3_moe`).
    `head`: what `compute_logits` computes (`rank_worker.models.heads`); None: the LM head.
    """

    # Checkpoint tensors the loader skips: those of a head this model does not build.
    ignored_checkpoint_names: frozenset[str] = frozenset()

    # Checkpoint module name -> (parameter module name, shard id) for packed parameters.
    packed_modules_mapping: dict[str, tuple[str, str | int]] = {  # noqa: RUF012
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        hf_config: Any,
        tp: TPInfo,
        dtype: torch.dtype,
        device: torch.device | str,
        attention_backend: AttentionBackend | None = None,
        fused_kernels: bool = False,
        *,
        mlp_factory: MLPFactory | None = None,
        head: HeadSpec | None = None,
    ) -> None:
        super().__init__()
        backend = attention_backend or get_backend("torch")
        self.config = hf_config
        self.tp = tp
        self.fused_kernels = fused_kernels
        self.model = Qwen3Model(
            hf_config, tp, backend, dtype=dtype, device=device, fused=fused_kernels,
            mlp_factory=mlp_factory,
        )  # fmt: skip
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.head = self._build_head(head or HeadSpec(), dtype=dtype, device=device)

    def _build_head(
        self, spec: HeadSpec, *, dtype: torch.dtype, device: torch.device | str
    ) -> Head:
        """The output head `spec` names (`rank_worker.models.heads`). Heads without an LM head build
        none (Qwen3-Embedding ships no `lm_head`; a causal checkpoint served as an embedder
        has one, which the loader then skips)."""
        cfg, tp = self.config, self.tp
        if spec.kind == "last_token":
            self.ignored_checkpoint_names = frozenset({"lm_head.weight"})
            return LastTokenHead(cfg.hidden_size, tp)
        if spec.kind == "seq_cls":
            self.ignored_checkpoint_names = frozenset({"lm_head.weight"})
            self.score = ClassifierWeight(
                spec.num_labels, cfg.hidden_size, dtype=dtype, device=device
            )
            return ClassifierHead(self.score, tp)
        self.lm_head = ParallelLMHead(
            cfg.vocab_size,
            cfg.hidden_size,
            tp,
            dtype=dtype,
            device=device,
            tie_to=self.model.embed_tokens if self.tie_word_embeddings else None,
        )
        if spec.kind == "token_score":
            assert spec.token_ids is not None
            return TokenScoreHead(self.lm_head, spec.token_ids)
        return LMHead(self.lm_head)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[KVCachePair],
    ) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata, kv_caches)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The head's rows: `[B', head.width]` fp32 on rank 0 (logits for an LM head)."""
        return self.head(hidden)
