"""The EAGLE-3 draft head: one Llama decoder layer over `[embedding ; fc(target states)]`.

Split: none. The head is replicated: every rank holds all of it and computes all of it, with
no collective of its own (the target's vocab-parallel embedding, which the caller uses, issues
one all-reduce). Why replicated rather than sharded as the target: a one-layer head is small
(about 0.8 GB in bf16 for Qwen3-8B's, lm_head over 32k draft tokens included), sharding it
would add two all-reduces per layer and a logits gather to each of the k chained draft steps,
and with every rank computing the same argmax no rank waits for rank 0 to learn the draft
tokens: the chain runs to its end on every rank and only rank 0 hands the tokens on.

One entry at position p (the research notes' section 3; training calls it base position p):

    e = embed(token after p)                       [T, H]   (the target's table)
    h = fc(target states at p) or the previous entry's y   [T, H]
    residual = h  (speculators' norm_before_residual: hidden_norm(h))
    z = [input_layernorm(e) ; hidden_norm(h)]      [T, 2H]  embedding first
    y = residual + o_proj(attention(q, k, v of z, RoPE at p over this head's own cache))
    y = y + down(silu(gate(n)) * up(n)),  n = post_attention_layernorm(y)
    draft = argmax(lm_head(norm(y))) over the draft vocabulary, + d2t[draft] -> a target id

`y` (before the final norm) is what the next chained entry takes as h.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from rank_worker.attention.backend import AttentionBackend
from rank_worker.attention.metadata import AttentionMetadata
from rank_worker.models.layers import RMSNorm, RopeSpec, RotaryEmbedding
from rank_worker.models.qwen3 import KVCachePair
from rank_worker.spec.eagle3_format import Eagle3HeadConfig


class Eagle3Head(nn.Module):
    """See the module docstring. `max_positions`: the cos/sin table's length (the engine's
    max_model_len may exceed the head's own max_position_embeddings: RoPE extends)."""

    def __init__(
        self,
        cfg: Eagle3HeadConfig,
        backend: AttentionBackend,
        *,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        h, i = cfg.hidden_size, cfg.intermediate_size
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        kw = dict(dtype=dtype, device=device)

        def linear(n_in: int, n_out: int) -> nn.Linear:
            return nn.Linear(n_in, n_out, bias=False, **kw)

        self.fc = linear(3 * h, h)
        self.q_proj, self.k_proj, self.v_proj = (
            linear(2 * h, q),
            linear(2 * h, kv),
            linear(2 * h, kv),
        )
        self.o_proj = linear(q, h)
        self.gate_proj, self.up_proj, self.down_proj = linear(h, i), linear(h, i), linear(i, h)
        eps = cfg.rms_norm_eps
        self.hidden_norm = RMSNorm(h, eps, **kw)
        self.input_layernorm = RMSNorm(h, eps, **kw)
        self.post_attention_layernorm = RMSNorm(h, eps, **kw)
        self.norm = RMSNorm(h, eps, **kw)
        self.lm_head = linear(h, cfg.draft_vocab_size)
        self.register_buffer(
            "d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64, device=device)
        )
        rope = RopeSpec(
            "default", cfg.head_dim, cfg.rope_theta, max(max_positions, cfg.max_position_embeddings)
        )
        self.rotary = RotaryEmbedding(rope, device=device)
        self.backend = backend
        self.scale = cfg.head_dim**-0.5
        # The cache holds the model dtype or fp8 at scale 1 (a head ships no KV scales).
        self.kv_scales = torch.ones(2, dtype=torch.float32, device=device)

    # Canonical tensor name (`rank_worker.spec.eagle3_format`) -> this module's parameter.
    _PARAMS: ClassVar[dict[str, str]] = {
        "fc.weight": "fc.weight",
        "midlayer.self_attn.q_proj.weight": "q_proj.weight",
        "midlayer.self_attn.k_proj.weight": "k_proj.weight",
        "midlayer.self_attn.v_proj.weight": "v_proj.weight",
        "midlayer.self_attn.o_proj.weight": "o_proj.weight",
        "midlayer.mlp.gate_proj.weight": "gate_proj.weight",
        "midlayer.mlp.up_proj.weight": "up_proj.weight",
        "midlayer.mlp.down_proj.weight": "down_proj.weight",
        "midlayer.hidden_norm.weight": "hidden_norm.weight",
        "midlayer.input_layernorm.weight": "input_layernorm.weight",
        "midlayer.post_attention_layernorm.weight": "post_attention_layernorm.weight",
        "norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight",
        "d2t": "d2t",
    }

    @torch.no_grad()
    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy the head's tensors in (shapes were checked at start: `read_eagle3_config`)."""
        own = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        for canon, name in self._PARAMS.items():
            own[name].copy_(tensors[canon].to(own[name].dtype))

    def fc_states(self, aux: torch.Tensor) -> torch.Tensor:
        """`aux [T, 3H]` (the target's three states, low to high) -> `[T, H]`."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCachePair,
    ) -> torch.Tensor:
        """Entries `[T]`: `embeds [T, H]`, `hidden [T, H]` (fc output or previous y) -> y `[T, H]`
        (before the final norm); stores each entry's K/V at its slot."""
        cfg = self.cfg
        t = embeds.shape[0]
        normed_h, z = self._layer_inputs(embeds, hidden)
        residual = normed_h if cfg.norm_before_residual else hidden
        q = self.q_proj(z).view(t, cfg.num_heads, cfg.head_dim)
        k, v = self._kv(z)
        q, k = self.rotary(positions, q, k)
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, self.kv_scales)
        y = residual + self.o_proj(o.reshape(t, -1))
        n = self.post_attention_layernorm(y)
        return y + self.down_proj(F.silu(self.gate_proj(n)) * self.up_proj(n))

    def store_entries(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache: KVCachePair,
    ) -> None:
        """Only the K/V of entries `[T]` (inputs as `forward`), stored at `slot_mapping [T]`:
        all a RUN plan's entries are for (later entries attend to them; their own y is never
        read), without the attention, o_proj and MLP that `forward` adds. The same values
        `forward` stores."""
        _, z = self._layer_inputs(embeds, hidden)
        k, v = self._kv(z)
        k = self.rotary.rotate(positions, k)
        self.backend.store_kv(k, v, *kv_cache, slot_mapping, self.kv_scales)

    def _layer_inputs(
        self, embeds: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(hidden_norm(h) [T, H], z = [input_layernorm(e) ; hidden_norm(h)] [T, 2H])`."""
        normed_h = self.hidden_norm(hidden)
        return normed_h, torch.cat([self.input_layernorm(embeds), normed_h], dim=-1)

    def _kv(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`z [T, 2H]` -> k, v `[T, num_kv_heads, head_dim]` (k not yet rotated)."""
        cfg, t = self.cfg, z.shape[0]
        k = self.k_proj(z).view(t, cfg.num_kv_heads, cfg.head_dim)
        return k, self.v_proj(z).view(t, cfg.num_kv_heads, cfg.head_dim)

    def draft_tokens(self, y: torch.Tensor) -> torch.Tensor:
        """`y [T, H]` -> the greedy draft of each entry as a target id `[T]` int64."""
        draft = self.lm_head(self.norm(y)).float().argmax(dim=-1)  # [T] draft-vocab ids
        return draft + self.d2t[draft]
