"""RMSNorm, optionally fused with the residual add that precedes it.

Replicated on every rank (the hidden states are whole on every rank between the parallel
blocks); its forward issues no collective.
"""

from __future__ import annotations

from typing import overload

import torch
from torch import nn

from rank_worker.models.layers.params import make_param, replicated_weight_loader


class RMSNorm(nn.Module):
    """`weight * x / sqrt(mean(x^2) + eps)` over the last dimension.

    Split: none; the `[dim]` weight is replicated. Forward: no collective.
    `norm(x)` returns the normed tensor; `norm(x, residual)` first adds `residual` (the
    pre-norm residual stream of a decoder layer) and returns `(normed, x + residual)`, so the
    layer never materialises the sum twice. Its weight also serves Qwen3's per-head q/k norm
    (`dim = head_dim`), which the attention layer applies itself (fused with the rotary
    embedding when `fused`, see `Qwen3Attention`).

    `fused=True`: one Triton kernel per call (`kernels.rmsnorm`: the add and the norm in one
    pass, rounding where transformers rounds); False: plain torch, the reference and the CPU
    path (about 8 eager ops).
    """

    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        fused: bool = False,
    ) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.fused = fused
        self.weight = make_param(
            (dim,), dtype=dtype, device=device, weight_loader=replicated_weight_loader
        )
        if fused:
            from kernels.rmsnorm import fused_add_rms_norm, rms_norm

            # Bound to the parameter itself, not read through nn.Module.__getattr__ per call
            # (a microsecond or two, twice per layer per eager step): loads and updates write
            # into this object in place.
            weight = self.weight
            self._rms_norm = lambda x: rms_norm(x, weight, eps)
            self._fused_add_rms_norm = lambda x, r: fused_add_rms_norm(x, r, weight, eps)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 even for bf16 activations (as Hugging Face does): the mean of
        # squares of thousands of features loses too much precision in 8 mantissa bits.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            if residual is None:
                return self._rms_norm(x)
            return self._fused_add_rms_norm(x, residual)
        if residual is None:
            return self._norm(x)
        new_residual = x + residual  # [num_tokens, hidden], the stream the next block adds to
        return self._norm(new_residual), new_residual
