"""The gated activation of the Qwen3 MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """`silu(gate) * up` for `x = [gate | up]` along the last dimension.

    Split: no weights; it runs on this rank's slice of the intermediate features, which is why
    the merged gate/up layer keeps each rank's gate and up shards side by side. Forward: no
    collective. Input `[num_tokens, 2 * I_local]`, output `[num_tokens, I_local]`.
    `fused=True` runs it as one Triton kernel (`kernels.activation`: one read of x, one write,
    instead of eager silu then mul); False is the plain-torch reference (CPU).
    """

    def __init__(self, *, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused
        if fused:
            from kernels.activation import silu_and_mul

            self._kernel = silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self._kernel(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
