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

Hooks: a decoder layer is called as a module (its hooks run); the blocks inside it are called
through their `forward` (no hooks), which an eager step pays for 28 times otherwise
(`Qwen3DecoderLayer`).

Parameter names mirror the Hugging Face checkpoint names, except where several checkpoint
tensors are packed into one parameter (`packed_modules_mapping`), so the loader can map names
without a table per model.

Pipeline parallelism (`rank_worker.pp`): a model built for one stage holds that stage's decoder
layers only (the others are `MissingLayer`s without parameters, so every layer keeps its
checkpoint name `model.layers.{i}`), the embedding on the first stage only, the final norm and
the head on the last only. A stage after the first starts from the previous stage's
`StageHandoff`; a stage before the last returns its own instead of hidden states. On a last
stage that is not the first, a tied LM head has no embedding to share: it holds its own copy,
loaded from `model.embed_tokens.weight` (`checkpoint_aliases`).
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
    RMSNorm,
    RopeSpec,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
)
from rank_worker.models.model_spec import HeadSpec
from rank_worker.models.quantization import fp8_quant_of
from rank_worker.models.qwen3_attention import KVCachePair, Qwen3Attention, head_dim_of
from rank_worker.pp import PipelineStage, StageHandoff
from rank_worker.tp import TPInfo

__all__ = ["KVCachePair", "Qwen3ForCausalLM", "Qwen3MLP", "Qwen3Model", "head_dim_of"]

# layer index -> that layer's MLP (`[T, hidden] -> [T, hidden]`, all-reduced), for models whose
# layers differ there (Qwen3-MoE's sparse and dense layers); None: Qwen3's dense MLP everywhere.
MLPFactory = Callable[[int], nn.Module]


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
        # Called directly, as `Qwen3DecoderLayer._blocks`.
        self._blocks = (self.gate_up_proj.forward, self.act.forward, self.down_proj.forward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up_proj, act, down_proj = self._blocks
        return down_proj(act(gate_up_proj(x)))  # [T, hidden], all-reduced


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
        # The blocks' `forward`s, in a plain attribute and called directly: the decoder layer
        # is the unit a hook watches (`benchmarks.op_count` hooks the layers); inside one, each
        # `self.<block>` read (nn.Module.__getattr__) and each call through nn.Module.__call__
        # cost a few microseconds, about twenty per layer per eager step. So a hook registered
        # on a block inside a layer (a norm, the attention, the MLP, a projection) does not run.
        self._blocks = (
            self.input_layernorm.forward,
            self.self_attn.forward,
            self.post_attention_layernorm.forward,
            self.mlp.forward,
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        kv_cache: KVCachePair,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns `(block output, residual stream)`; the next norm adds them (fused)."""
        input_layernorm, self_attn, post_attention_layernorm, mlp = self._blocks
        if residual is None:
            residual = hidden
            hidden = input_layernorm(hidden)
        else:
            hidden, residual = input_layernorm(hidden, residual)
        hidden = self_attn(positions, hidden, meta, kv_cache)
        hidden, residual = post_attention_layernorm(hidden, residual)
        return mlp(hidden), residual


class MissingLayer(nn.Module):
    """The place of a decoder layer another pipeline stage holds: no parameters, never run."""

    def forward(self, *args: Any) -> None:
        raise RuntimeError("a decoder layer of another pipeline stage was called")


class Qwen3Model(nn.Module):
    """The decoder body; `stage`: the pipeline stage it is built for (None: the whole model)."""

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
        stage: PipelineStage | None = None,
    ) -> None:
        super().__init__()
        stage = stage or PipelineStage.whole(hf_config.num_hidden_layers)
        self.stage = stage
        self.embed_tokens = (
            VocabParallelEmbedding(
                hf_config.vocab_size, hf_config.hidden_size, tp, dtype=dtype, device=device
            )
            if stage.is_first
            else None
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
            if i in stage.layers
            else MissingLayer()
            for i in range(hf_config.num_hidden_layers)
        )
        self.norm = (
            RMSNorm(
                hf_config.hidden_size,
                hf_config.rms_norm_eps,
                dtype=dtype,
                device=device,
                fused=fused,
            )
            if stage.is_last
            else None
        )
        # This stage's decoder layers, in a plain tuple: slicing the ModuleList builds a new
        # ModuleList (a registration per layer) on every forward.
        self._stage_layers = tuple(self.layers[stage.start : stage.end])
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
        handoff: StageHandoff | None = None,
    ) -> torch.Tensor | StageHandoff:
        """`kv_caches`: one pair per layer of this stage. `handoff`: the previous stage's
        output (every stage but the first). Returns the normed hidden states `[T, hidden]` on
        the last stage, this stage's `StageHandoff` on the others."""
        stage = self.stage
        residual: torch.Tensor | None = None
        if handoff is None:
            hidden = self.embed_tokens(input_ids)  # [T, hidden]
        else:
            hidden, residual = handoff
        wanted = self.capture_layers
        # A clone: the fused add+norm of layer 1 updates the residual (this tensor) in place.
        states = {0: hidden.clone()} if wanted else {}
        for i, layer, kv_cache in zip(stage.layers, self._stage_layers, kv_caches, strict=True):
            if i in wanted and i > 0:
                states[i] = hidden + residual  # the input of layer i, before its norm
            hidden, residual = layer(positions, hidden, residual, meta, kv_cache)
        if not stage.is_last:
            return StageHandoff(hidden, residual)
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
    `stage`: the pipeline stage this shard is of (None: the whole model); `forward` then returns
    a `StageHandoff` on every stage but the last, and only the last has a head (`head` None
    elsewhere).
    """

    # Checkpoint tensors the loader skips: those of a head this model does not build.
    ignored_checkpoint_names: frozenset[str] = frozenset()
    # Checkpoint name prefixes the loader skips: the tensors other pipeline stages hold.
    ignored_checkpoint_prefixes: tuple[str, ...] = ()
    # Checkpoint name -> the parameter name it loads into, where they differ: a tied LM head on
    # a last stage without the embedding loads the embedding's table.
    checkpoint_aliases: dict[str, str] = {}  # noqa: RUF012

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
        stage: PipelineStage | None = None,
    ) -> None:
        super().__init__()
        backend = attention_backend or get_backend("torch")
        self.config = hf_config
        self.tp = tp
        self.fused_kernels = fused_kernels
        self.model = Qwen3Model(
            hf_config, tp, backend, dtype=dtype, device=device, fused=fused_kernels,
            mlp_factory=mlp_factory, stage=stage,
        )  # fmt: skip
        stage = self.model.stage
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.ignored_checkpoint_prefixes = _elsewhere(stage, self.tie_word_embeddings)
        self.head: Head | None = None
        if stage.is_last:
            self.head = self._build_head(head or HeadSpec(), dtype=dtype, device=device)
        if self.tie_word_embeddings and stage.is_last and not stage.is_first:
            self.checkpoint_aliases = {"model.embed_tokens.weight": "lm_head.weight"}

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
            # None on a last stage without the embedding: a copy of its own (the docstring).
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
        handoff: StageHandoff | None = None,
    ) -> torch.Tensor | StageHandoff:
        # [T, hidden] (the last stage), or this stage's hand-off (`Qwen3Model.forward`)
        return self.model(input_ids, positions, attn_metadata, kv_caches, handoff)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The head's rows: `[B', head.width]` fp32 on rank 0 of the (last) stage's TP group
        (logits for an LM head)."""
        assert self.head is not None, "compute_logits on a pipeline stage without the head"
        return self.head(hidden)


def _elsewhere(stage: PipelineStage, tied: bool) -> tuple[str, ...]:
    """Checkpoint name prefixes of what other pipeline stages hold (nothing for the whole
    model): their layers, the embedding off the first stage (unless a tied head on this last
    stage loads it), the final norm and the LM head off the last."""
    prefixes = [f"model.layers.{i}." for i in range(stage.num_layers) if i not in stage.layers]
    if not stage.is_first and not (tied and stage.is_last):
        prefixes.append("model.embed_tokens.")
    if not stage.is_last:
        prefixes += ["model.norm.", "lm_head."]
    return tuple(prefixes)
