"""Load this rank's shard of a Hugging Face safetensors checkpoint into the model.

Every checkpoint tensor is read whole (one at a time, so peak host memory is one tensor, not the
model) and handed to its parameter's `weight_loader`, which cuts this rank's shard out of it.
Packed parameters (q/k/v → qkv_proj, gate/up → gate_up_proj) are filled part by part.

Strictness is the point: every parameter part must be loaded exactly once, and a checkpoint
tensor with no home is an error. A checkpoint from another architecture, a truncated download
or a renamed layer fails here with the tensor's name, not later as garbage text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# Checkpoint tensors that are derived, not learnt: older exports saved the rotary table.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightLoadError(ValueError):
    """The checkpoint does not match the model: a missing, unexpected or duplicated tensor."""


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: from the index when sharded, else the single file."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise WeightLoadError(f"{INDEX_FILE} names shard files that do not exist: {missing}")
        return files
    if (model_dir / SINGLE_FILE).exists():
        return [model_dir / SINGLE_FILE]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {model_dir}")
    return files


def iterate_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` for every tensor of the checkpoint, on the CPU."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open objects are not iterable
                yield name, f.get_tensor(name)


def _expected_parts(model: nn.Module) -> dict[str, tuple[str, object]]:
    """Every (parameter, shard_id) the checkpoint must fill, keyed by checkpoint tensor name."""
    mapping: dict[str, tuple[str, str | int]] = getattr(model, "packed_modules_mapping", {})
    packed_by_param: dict[str, list[tuple[str, str | int]]] = {}
    for ckpt_module, (param_module, shard_id) in mapping.items():
        packed_by_param.setdefault(param_module, []).append((ckpt_module, shard_id))
    expected: dict[str, tuple[str, object]] = {}
    # named_parameters() lists a tied (shared) parameter once, under its first owner.
    for param_name, _ in model.named_parameters():
        *prefix, module, leaf = param_name.split(".")
        parts = packed_by_param.get(module)
        if parts is None:
            expected[param_name] = (param_name, None)
            continue
        for ckpt_module, shard_id in parts:
            expected[".".join([*prefix, ckpt_module, leaf])] = (param_name, shard_id)
    return expected


def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    """Fill every parameter of `model` (this rank's shard) from the checkpoint in `model_dir`.

    Raises `WeightLoadError` naming the tensor when one is missing, unexpected, duplicated or of
    the wrong shape. Dtype conversion to the parameter's dtype happens in the copy.
    """
    params = dict(model.named_parameters())
    expected = _expected_parts(model)
    tied = bool(getattr(model, "tie_word_embeddings", False))
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in iterate_checkpoint(model_dir):
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if tied and name == "lm_head.weight":
            # Some tied checkpoints also store the (identical) head; the embedding provides it.
            continue
        if name not in expected:
            unexpected.append(name)
            continue
        if name in loaded:
            raise WeightLoadError(f"checkpoint tensor {name!r} appears more than once")
        param_name, shard_id = expected[name]
        param = params[param_name]
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            raise WeightLoadError(f"parameter {param_name!r} has no weight_loader")
        try:
            loader(param, tensor, shard_id)
        except ValueError as e:
            raise WeightLoadError(f"cannot load {name!r} into {param_name!r}: {e}") from e
        loaded.add(name)
    if unexpected:
        raise WeightLoadError(
            f"unexpected checkpoint tensors (no matching parameter): {sorted(unexpected)}"
        )
    missing = sorted(set(expected) - loaded)
    if missing:
        raise WeightLoadError(f"checkpoint tensors missing for the model: {missing}")
