"""What a checkpoint's config says about its rotary embedding, resolved once.

`RopeSpec.from_config(hf_config)` reads the three spellings configs use:

- transformers >= 5: `rope_parameters = {"rope_type": ..., "rope_theta": ..., <scaling keys>}`;
- older config.json: top-level `rope_theta` plus `rope_scaling = {"rope_type" | "type": ...}`
  (`type` is the pre-4.45 name of `rope_type`).

Supported: plain RoPE (`default`) and static YaRN (`yarn`, arXiv 2309.00071). Any other type is
refused by name at construction rather than served with subtly wrong positions.

YaRN is static here, as in transformers and vLLM: its frequencies and attention factor apply at
every position of every request, short prompts included (the Qwen3 model cards warn of this).
The attention factor multiplies both cos and sin, so q and k each carry it and the attention
logits scale by its square (the paper's 1/t); folding it into the cos/sin table leaves the
kernels, which read only that table, unchanged.

The same spec gives the model's table length and rank 0's default `max_model_len`
(`max_positions`), so the two cannot disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True)
class YarnParams:
    """The YaRN keys of a rope config, defaults filled in as transformers does."""

    factor: float  # how much longer than the pretraining length positions may go
    original_max_position_embeddings: int  # L0, the pretraining length
    beta_fast: float = 32.0  # rotations within L0 above which a frequency is kept (extrapolated)
    beta_slow: float = 1.0  # rotations within L0 below which a frequency is divided by `factor`
    attention_factor: float | None = None  # explicit factor; None: derived from factor/mscale
    mscale: float | None = None  # DeepSeek-style numerator/denominator of the derived factor
    mscale_all_dim: float | None = None
    truncate: bool = True  # round the correction range outwards to whole dimensions


@dataclass(frozen=True)
class RopeSpec:
    """A checkpoint's rotary embedding: frequencies, the cos/sin scale, and the positions the
    table must hold."""

    rope_type: str  # "default" or "yarn"
    head_dim: int  # rotated dimensions (Qwen3 rotates the whole head)
    theta: float  # the RoPE base
    max_position_embeddings: int  # the config's field, as written
    yarn: YarnParams | None = None  # set iff rope_type == "yarn"

    @classmethod
    def from_config(cls, hf_config: Any) -> RopeSpec:
        params = _rope_dict(hf_config)
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"RoPE type {rope_type!r} is not supported; supported rope types: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        partial = params.get(
            "partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1)
        )
        if partial not in (None, 1, 1.0):
            raise ValueError(f"partial_rotary_factor {partial} is not supported (only 1.0)")
        theta = params.get("rope_theta")
        if theta is None:
            theta = getattr(hf_config, "rope_theta", None)
        if theta is None:
            raise ValueError("the config has neither rope_theta nor rope_parameters['rope_theta']")
        max_pos = int(hf_config.max_position_embeddings)
        head_dim = getattr(hf_config, "head_dim", None) or (
            hf_config.hidden_size // hf_config.num_attention_heads
        )
        yarn = _yarn_params(params, hf_config, max_pos) if rope_type == "yarn" else None
        return cls(rope_type, int(head_dim), float(theta), max_pos, yarn)

    @property
    def max_positions(self) -> int:
        """Longest sequence the model serves by default, and the cos/sin table's length.

        YaRN: `original_max_position_embeddings × factor` unless max_position_embeddings says
        more. Qwen3 configs keep max_position_embeddings at 40960 while L0 = 32768, so with
        factor 4 this gives the 131072 of the model cards' `--max-model-len` (what older vLLM
        derived; vLLM 0.33 stopped multiplying and needs max_position_embeddings overridden).
        """
        if self.yarn is None:
            return self.max_position_embeddings
        scaled = int(self.yarn.original_max_position_embeddings * self.yarn.factor)
        return max(self.max_position_embeddings, scaled)

    @property
    def max_positions_source(self) -> str:
        """Where `max_positions` comes from, in words (for error messages)."""
        y = self.yarn
        if y is None or self.max_position_embeddings >= self.max_positions:
            return "the checkpoint's max_position_embeddings"
        return (
            f"yarn: original_max_position_embeddings {y.original_max_position_embeddings} × "
            f"factor {y.factor:g}"
        )

    @property
    def attention_factor(self) -> float:
        """The scale of cos and sin (1 for plain RoPE)."""
        y = self.yarn
        if y is None:
            return 1.0
        if y.attention_factor is not None:
            return float(y.attention_factor)
        if y.mscale and y.mscale_all_dim:
            return _yarn_mscale(y.factor, y.mscale) / _yarn_mscale(y.factor, y.mscale_all_dim)
        return _yarn_mscale(y.factor)

    def correction_range(self) -> tuple[float, float]:
        """YaRN's (low, high) frequency indices: below low a frequency is kept, above high it is
        divided by `factor`, in between the two are blended linearly."""
        y = self.yarn
        if y is None:
            raise ValueError("plain RoPE has no correction range")
        dim, base, length = self.head_dim, self.theta, y.original_max_position_embeddings

        def dim_of(rotations: float) -> float:
            # The frequency index whose wavelength fits `rotations` turns into L0 positions.
            return dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = dim_of(y.beta_fast), dim_of(y.beta_slow)
        if y.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def inv_freq(self) -> torch.Tensor:
        """`[head_dim / 2]` fp32 inverse frequencies, bit-equal to transformers'."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        pos_freqs = self.theta**exponents  # [head_dim / 2] wavelengths / 2π
        if self.yarn is None:
            return 1.0 / pos_freqs
        extrapolated = 1.0 / pos_freqs
        interpolated = 1.0 / (self.yarn.factor * pos_freqs)
        low, high = self.correction_range()
        if low == high:
            high += 0.001  # a one-index ramp: avoid dividing by zero
        ramp = (torch.arange(self.head_dim // 2, dtype=torch.float32) - low) / (high - low)
        keep = 1 - ramp.clamp(0, 1)  # 1: extrapolated (original frequency), 0: interpolated
        return interpolated * (1 - keep) + extrapolated * keep

    def cos_sin_cache(self, max_position: int | None = None) -> torch.Tensor:
        """`[max_position, head_dim]` fp32: cos of the head_dim/2 frequencies, then their sin,
        both times the attention factor (default length: `max_positions`)."""
        n = self.max_positions if max_position is None else max_position
        # fp32 positions times fp32 inverse frequencies, as transformers computes them, so that
        # logits match the reference to fp32 rounding.
        t = torch.arange(n, dtype=torch.int64).float()
        freqs = t[:, None] * self.inv_freq()[None, :]  # [n, head_dim / 2]
        scale = self.attention_factor
        return torch.cat((freqs.cos() * scale, freqs.sin() * scale), -1)


def _rope_dict(hf_config: Any) -> dict[str, Any]:
    """The rope parameters of any spelling as one dict (`rope_parameters` wins)."""
    params = getattr(hf_config, "rope_parameters", None)
    scaling = getattr(hf_config, "rope_scaling", None)
    if isinstance(params, dict) and _names_type(params):
        return dict(params)
    if isinstance(scaling, dict) and _names_type(scaling):
        merged = dict(params) if isinstance(params, dict) else {}
        merged.update(scaling)
        return merged
    return dict(params) if isinstance(params, dict) else {}


def _names_type(d: dict[str, Any]) -> bool:
    return d.get("rope_type") is not None or d.get("type") is not None


def _yarn_params(params: dict[str, Any], hf_config: Any, max_pos: int) -> YarnParams:
    original = params.get("original_max_position_embeddings")
    if original is None:
        # transformers' standardize_rope_params: a top-level field (Phi-3), else the config's own.
        original = getattr(hf_config, "original_max_position_embeddings", None) or max_pos
    factor = params.get("factor")
    if factor is None:
        factor = max_pos / original  # transformers' fallback (DeepSeek-V3 configs)
    if factor < 1:
        raise ValueError(f"yarn needs factor >= 1, got {factor}")
    return YarnParams(
        factor=float(factor),
        original_max_position_embeddings=int(original),
        # `or`: transformers treats 0 / None as unset.
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature √(1/t) = 0.1·ln(s) + 1 (paper eq. 22), times `mscale`."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0
