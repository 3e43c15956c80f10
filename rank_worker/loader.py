"""Load this rank's shard of a Hugging Face safetensors checkpoint into the model.

Every checkpoint tensor is read whole (one at a time, so peak host memory is one tensor, not the
model) and handed to its parameter's `weight_loader`, which cuts this rank's shard out of it.
Packed parameters (q/k/v → qkv_proj, gate/up → gate_up_proj) are filled part by part. A module
whose checkpoint tensors do not follow its parameter names (the MoE experts: one tensor per
expert and projection, packed into two parameters) names them itself (`checkpoint_parts`);
tensors it does not keep on this rank (other ranks' experts) are checked for presence and
shape from the file header and never read.

Strictness is the point: every parameter part must be loaded exactly once, and a checkpoint
tensor with no home is an error. A checkpoint from another architecture, a truncated download
or a renamed layer fails here with the tensor's name, not later as garbage text.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from rank_worker.layers.params import CheckpointPart

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


def _expected_parts(model: nn.Module) -> dict[str, CheckpointPart]:
    """Every part the checkpoint must provide, keyed by checkpoint tensor name; `param` is the
    full parameter name, or None for a tensor this rank only checks (`CheckpointPart`)."""
    expected: dict[str, CheckpointPart] = {}
    # Modules that name some of their checkpoint tensors (`checkpoint_parts`); the parameters
    # those name are theirs to fill, the module's other parameters follow the generic rule.
    owned: set[str] = set()
    for prefix, module in model.named_modules():
        parts = getattr(module, "checkpoint_parts", None)
        if parts is None:
            continue
        for ckpt_name, part in parts().items():
            param = None if part.param is None else f"{prefix}.{part.param}"
            expected[f"{prefix}.{ckpt_name}"] = part._replace(param=param)
            if param is not None:
                owned.add(param)
    mapping: dict[str, tuple[str, str | int]] = getattr(model, "packed_modules_mapping", {})
    packed_by_param: dict[str, list[tuple[str, str | int]]] = {}
    for ckpt_module, (param_module, shard_id) in mapping.items():
        packed_by_param.setdefault(param_module, []).append((ckpt_module, shard_id))
    # named_parameters() lists a tied (shared) parameter once, under its first owner.
    for param_name, _ in model.named_parameters():
        if param_name in owned:
            continue
        *prefix, module, leaf = param_name.split(".")
        packed = packed_by_param.get(module)
        if packed is None:
            expected[param_name] = CheckpointPart(param_name)
            continue
        for ckpt_module, shard_id in packed:
            expected[".".join([*prefix, ckpt_module, leaf])] = CheckpointPart(param_name, shard_id)
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
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open objects are not iterable
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if tied and name == "lm_head.weight":
                    # Some tied checkpoints also store the (identical) head; the embedding
                    # provides it.
                    continue
                if name not in expected:
                    unexpected.append(name)
                    continue
                if name in loaded:
                    raise WeightLoadError(f"checkpoint tensor {name!r} appears more than once")
                part = expected[name]
                if part.param is None:
                    shape = tuple(f.get_slice(name).get_shape())
                    if part.shape is not None and shape != tuple(part.shape):
                        raise WeightLoadError(
                            f"checkpoint tensor {name!r} has shape {shape}, the config implies "
                            f"{tuple(part.shape)}"
                        )
                    loaded.add(name)
                    continue
                _load_one(params, part, name, f.get_tensor(name))
                loaded.add(name)
    if unexpected:
        raise WeightLoadError(
            f"unexpected checkpoint tensors (no matching parameter): {sorted(unexpected)}"
        )
    missing = sorted(name for name in set(expected) - loaded if not expected[name].optional)
    if missing:
        raise WeightLoadError(f"checkpoint tensors missing for the model: {missing}")


def _load_one(
    params: dict[str, nn.Parameter], part: CheckpointPart, name: str, tensor: torch.Tensor
) -> None:
    assert part.param is not None
    param = params[part.param]
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        raise WeightLoadError(f"parameter {part.param!r} has no weight_loader")
    try:
        loader(param, tensor, part.shard_id)
    except ValueError as e:
        raise WeightLoadError(f"cannot load {name!r} into {part.param!r}: {e}") from e
