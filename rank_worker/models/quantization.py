"""Qwen3's FP8 checkpoints: what their config says, and how a shard of a block-quantized weight
is cut.

The format (each published `Qwen/Qwen3-*-FP8` config.json): `"quantization_config":
{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size":
[128, 128]}`. Every linear weight of the decoder layers (attention projections, MLP and expert
projections; not the MoE router) is `float8_e4m3fn` beside a `weight_scale_inv` fp32 tensor of
one scale per 128×128 block; embeddings, norms and the LM head stay in bf16. Activations are
quantized per token and 128-column group at run time (`kernels.fp8_gemm`).

The choice is made once, when the model is built: a layer built with an `Fp8BlockQuant` holds
fp8 weights and their scales and calls the W8A8 GEMM; one built without holds the model dtype
and calls `F.linear`. Nothing branches per step. Which GEMM: the Triton kernel where the layers
run the project's kernels (`layer_kernels` "triton": a GPU, or CPU under the interpreter), else
the dequantizing torch reference (the CPU path).

Tensor parallelism cuts weights along rows or columns; a cut must fall on a block boundary,
since a block's scale belongs to the whole block (`block_slice`). Where it would not, the model
refuses to build, naming the layer and the sizes, before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

FP8_DTYPE = torch.float8_e4m3fn
BLOCK = 128
_SUPPORTED = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}


@dataclass(frozen=True)
class Fp8BlockQuant:
    """Linear layers with 128×128 block-scaled e4m3 weights and dynamic activations.

    `kernel`: "triton" (the W8A8 Triton GEMM) or "torch" (dequantizing reference)."""

    kernel: str = "torch"
    block: int = BLOCK

    def __post_init__(self) -> None:
        if self.kernel not in ("torch", "triton"):
            raise ValueError(f"Fp8BlockQuant.kernel must be 'torch' or 'triton', got {self.kernel}")


def fp8_quant_of(hf_config: Any, fused: bool) -> Fp8BlockQuant | None:
    """The checkpoint's quantization: None for an unquantized one, `Fp8BlockQuant` for Qwen's
    FP8 format; any other `quantization_config` is refused with what differs."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    wrong = {
        key: qc.get(key)
        for key, want in _SUPPORTED.items()
        if (list(qc.get(key)) if isinstance(qc.get(key), list | tuple) else qc.get(key)) != want
    }
    if wrong:
        raise ValueError(
            f"unsupported quantization_config {qc}: {wrong} differ from the one supported "
            f"format, Qwen's block FP8 {_SUPPORTED}"
        )
    return Fp8BlockQuant(kernel="triton" if fused else "torch")


def scale_shape(rows: int, cols: int, block: int = BLOCK) -> tuple[int, int]:
    """`weight_scale_inv`'s shape for a `[rows, cols]` weight: one scale per block, the last
    row and column of blocks possibly partial."""
    return (-(-rows // block), -(-cols // block))


def block_slice(
    start: int, size: int, full: int | None, what: str, block: int = BLOCK
) -> tuple[int, int]:
    """The blocks `(first, count)` covering features `[start, start + size)` of a dimension of
    `full` features. The slice must start on a block boundary and end on one, or at the end of
    the dimension when `full` is given (None: a packed part or an activation's groups, which
    must be whole blocks): a cut inside a block would leave part of it with another rank's
    scale."""
    end = start + size
    if start % block or (end % block and end != full):
        of = "" if full is None else f" of {full}"
        raise ValueError(
            f"{what}: this rank's features [{start}, {end}){of} split a {block}×{block} "
            "block of the FP8 weights (each block has one scale); choose a tensor-parallel size "
            f"that cuts whole blocks"
        )
    return start // block, -(-end // block) - start // block


def check_fp8_tensor(full: torch.Tensor, what: str) -> None:
    """A quantized layer takes only float8_e4m3fn weights (no silent cast of a bf16 one)."""
    if full.dtype != FP8_DTYPE:
        raise ValueError(f"{what}: checkpoint weight is {full.dtype}, expected {FP8_DTYPE}")


def check_scale_tensor(full: torch.Tensor, what: str) -> None:
    if not full.dtype.is_floating_point or full.dtype == FP8_DTYPE:
        raise ValueError(f"{what}: weight_scale_inv is {full.dtype}, expected a float dtype")


def fp8_linear_fn(quant: Fp8BlockQuant):
    """`(x [T, K], w [N, K] e4m3, w_scale [N/128, K/128]) -> [T, N]` in x's dtype."""
    if quant.kernel == "triton":
        from kernels.fp8_gemm import fp8_linear

        return fp8_linear
    from kernels.fp8_gemm import fp8_linear_ref

    return fp8_linear_ref
