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
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
