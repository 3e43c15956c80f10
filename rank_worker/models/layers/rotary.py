"""Rotary position embedding (RoPE) in the neox layout that Qwen3 uses.

The head dimension is split in two halves `[x1 | x2]` rotated as pairs `(x1[i], x2[i])`
(Hugging Face's `rotate_half`), not interleaved pairs `(x[2i], x[2i+1])`. The frequencies, the
cos/sin scale and the table length come from a `RopeSpec` (plain RoPE or static YaRN; other
types are refused there).
"""

from __future__ import annotations

import torch
from torch import nn

from rank_worker.models.layers.rope_spec import RopeSpec


class RotaryEmbedding(nn.Module):
    """Rotates q and k by their token's absolute position.

    Split: none (no weights; the cos/sin table is replicated). Forward: no collective.
    `cos_sin_cache [max_position, head_dim]` fp32 holds cos of the head_dim/2 frequencies then
    their sin (both times the spec's attention factor, 1 for plain RoPE), the layout the Triton
    kernels read (`kernels.rotary`, `kernels.qk_norm_rope`); the torch path reads the two halves
    as views. Its length is `spec.max_positions`, the bound rank 0 checks max_model_len against.
    """

    def __init__(self, spec: RopeSpec, *, device: torch.device | str) -> None:
        super().__init__()
        if spec.head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {spec.head_dim}")
        self.spec = spec
        self.head_dim = spec.head_dim
        self.max_position = spec.max_positions
        # YaRN's attention factor is folded into the table (RopeSpec.cos_sin_cache), so the
        # Triton kernels and the torch path need nothing beyond it.
        self.register_buffer(
            "cos_sin_cache", spec.cos_sin_cache(self.max_position).to(device), persistent=False
        )  # [max_position, head_dim]

    @property
    def cos_cache(self) -> torch.Tensor:
        return self.cos_sin_cache[:, : self.head_dim // 2]  # [max_position, head_dim / 2]

    @property
    def sin_cache(self) -> torch.Tensor:
        return self.cos_sin_cache[:, self.head_dim // 2 :]  # [max_position, head_dim / 2]

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [num_tokens, num_heads, head_dim]; cos/sin [num_tokens, 1, head_dim / 2] in x's dtype.
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`positions [num_tokens]`, `q [num_tokens, heads, head_dim]`, `k [num_tokens, kv_heads,
        head_dim]` -> rotated (q, k), new tensors (the plain-torch path)."""
        cos = self.cos_cache[positions].unsqueeze(1).to(q.dtype)  # [num_tokens, 1, head_dim / 2]
        sin = self.sin_cache[positions].unsqueeze(1).to(q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """One tensor `x [num_tokens, heads, head_dim]` rotated as `forward` rotates each (keys
        alone: an EAGLE-3 head's entries, `rank_worker.spec.eagle3_head`)."""
        cos = self.cos_cache[positions].unsqueeze(1).to(x.dtype)  # [num_tokens, 1, head_dim / 2]
        sin = self.sin_cache[positions].unsqueeze(1).to(x.dtype)
        return self._rotate(x, cos, sin)
