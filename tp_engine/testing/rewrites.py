"""Checkpoints rewritten from others, file by file: Qwen's FP8 format and back, a layer-dropped
draft model, a RoPE-scaled copy."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

FP8_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
# The decoder layers' linear weights, the ones Qwen's FP8 checkpoints store in e4m3 (the MoE
# router `mlp.gate.weight`, norms, embedding and head stay in their dtype).
_FP8_LINEAR = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)"
    r"\.weight"
)


def rewrite_checkpoint(
    src: Path,
    out: Path,
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
    edit_config: Callable[[dict[str, Any]], None],
) -> Path:
    """Copy checkpoint `src` to `out` file by file (one safetensors file in memory at a time),
    each tensor replaced by `convert(name, tensor)`; the index follows; config.json edited."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from rank_worker.models.loader import INDEX_FILE, safetensors_files

    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != INDEX_FILE:
            shutil.copy(f, out / f.name)
    weight_map: dict[str, str] = {}
    total = 0
    for path in safetensors_files(src):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open objects are not iterable
                tensors.update(convert(name, f.get_tensor(name)))
        save_file(tensors, str(out / path.name), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = path.name
            total += t.numel() * t.element_size()
    if (src / INDEX_FILE).exists():
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    config_file = out / "config.json"
    config = json.loads(config_file.read_text())
    edit_config(config)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def quantize_checkpoint_fp8(src_dir: str | Path, out_dir: str | Path) -> Path:
    """Write `src_dir`'s checkpoint in Qwen's FP8 format to `out_dir`: every decoder linear
    weight block-quantized to float8_e4m3fn with its `weight_scale_inv` (fp32, one per 128×128
    block: the block's max magnitude / 448), the rest unchanged, and config.json's
    `quantization_config` (`FP8_QUANTIZATION_CONFIG`). Returns `out_dir`."""
    from kernels.fp8_gemm import quantize_block_fp8

    def convert(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if not _FP8_LINEAR.fullmatch(name):
            return {name: t}
        q, scale = quantize_block_fp8(t)
        return {name: q, name.removesuffix("weight") + "weight_scale_inv": scale}

    def edit(config: dict[str, Any]) -> None:
        config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)

    return rewrite_checkpoint(Path(src_dir), Path(out_dir), convert, edit)


def dequantize_checkpoint_fp8(src_dir: str | Path, out_dir: str | Path) -> Path:
    """The inverse for references: an FP8 checkpoint's weights dequantized (`W_fp8 *
    scale_inv`, exactly, in float32) into an unquantized checkpoint that transformers loads on
    any device. Other tensors keep their dtype; config.json loses `quantization_config` and
    says float32. Returns `out_dir`."""
    from kernels.fp8_gemm import dequantize_block_fp8

    pending: dict[str, torch.Tensor] = {}

    def convert(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        # A weight and its scale may come in either order within a file.
        if name.endswith("weight_scale_inv"):
            weight = name.removesuffix("_scale_inv")
            other = pending.pop(weight, None)
            if other is None:
                pending[name] = t
                return {}
            return {weight: dequantize_block_fp8(other, t)}
        if t.dtype == torch.float8_e4m3fn:
            scale = pending.pop(name + "_scale_inv", None)
            if scale is None:
                pending[name] = t
                return {}
            return {name: dequantize_block_fp8(t, scale)}
        return {name: t}

    def edit(config: dict[str, Any]) -> None:
        config.pop("quantization_config", None)
        config["dtype"] = "float32"

    out = rewrite_checkpoint(Path(src_dir), Path(out_dir), convert, edit)
    if pending:
        raise ValueError(f"FP8 weights or scales without their partner: {sorted(pending)}")
    return out


def truncate_layers(src_dir: str | Path, out_dir: str | Path, num_layers: int) -> Path:
    """A copy of `src_dir`'s checkpoint with its first `num_layers` decoder layers only (the
    embeddings, final norm, head and tokenizer unchanged): a layer-dropped draft model for
    speculative decoding, which shares the target's vocabulary and agrees with it often.
    Returns `out_dir`."""
    layer = re.compile(r"model\.layers\.(\d+)\.")

    def convert(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        match = layer.match(name)
        return {} if match and int(match.group(1)) >= num_layers else {name: t}

    def edit(config: dict[str, Any]) -> None:
        if not 1 <= num_layers <= config["num_hidden_layers"]:
            raise ValueError(
                f"num_layers must be in [1, {config['num_hidden_layers']}], got {num_layers}"
            )
        config["num_hidden_layers"] = num_layers
        if "layer_types" in config:
            config["layer_types"] = config["layer_types"][:num_layers]

    return rewrite_checkpoint(Path(src_dir), Path(out_dir), convert, edit)


def with_rope_scaling(
    src_dir: str | Path, out_dir: str | Path, scaling: dict[str, Any], *, legacy: bool = False
) -> Path:
    """A copy of `src_dir`'s checkpoint (same weights) whose RoPE is scaled by `scaling` (e.g.
    `{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}`).

    `legacy=False` writes transformers 5's `rope_parameters` (the base `rope_theta` kept inside
    it); `legacy=True` writes a pre-5 config.json as published Qwen3 checkpoints have it: a
    top-level `rope_theta` and `scaling` as `rope_scaling`. Returns `out_dir`."""

    def edit(config: dict[str, Any]) -> None:
        params = config.pop("rope_parameters", None) or {}
        theta = params.get("rope_theta", config.pop("rope_theta", None))
        if legacy:
            config["rope_theta"] = theta
            config["rope_scaling"] = dict(scaling)
        else:
            config.pop("rope_scaling", None)
            config["rope_parameters"] = {"rope_theta": theta, **scaling}

    return rewrite_checkpoint(Path(src_dir), Path(out_dir), lambda n, t: {n: t}, edit)
