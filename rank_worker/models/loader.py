"""Load this rank's shard of a Hugging Face safetensors checkpoint into the model.

Every checkpoint tensor is read whole (one at a time, so peak host memory is one tensor, not the
model) and handed to the model's `WeightMap` (`rank_worker.models.weight_map`), which owns every name
rule and writes this rank's shard through each parameter's `weight_loader`. Tensors this rank
does not keep (other ranks' experts) are checked for presence and shape from the file header
and never read.

Strictness is the point: every parameter part must be loaded exactly once, and a checkpoint
tensor with no home is an error. A checkpoint from another architecture, a truncated download
or a renamed layer fails here with the tensor's name, not later as garbage text. Run-time
updates use the same map without that strictness (`WeightMap.prepare` / `commit`).
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from torch import nn

from rank_worker.models.weight_map import WeightLoadError, WeightMap

__all__ = ["INDEX_FILE", "SINGLE_FILE", "WeightLoadError", "load_checkpoint", "load_weights",
           "safetensors_files"]  # fmt: skip

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


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


def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    """Fill every parameter of `model` (this rank's shard) from the checkpoint in `model_dir`;
    `load_checkpoint` with a map built for the call."""
    load_checkpoint(WeightMap(model), model_dir)


def load_checkpoint(wmap: WeightMap, model_dir: str | Path) -> None:
    """Fill every parameter behind `wmap` from the checkpoint in `model_dir`.

    Raises `WeightLoadError` naming the tensor when one is missing, unexpected, duplicated or of
    the wrong shape. Dtype conversion to the parameter's dtype happens in the copy; an fp8
    model's weights must be stored in fp8 with their scales (no requantization on load).
    """
    loaded: set[str] = set()
    unexpected: list[str] = []
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open objects are not iterable
                # Published checkpoints store one tensor per expert, never the fused layout.
                targets = wmap.resolve(name, fused=False)
                if targets is None:
                    unexpected.append(name)
                    continue
                if not targets:  # derived, or a tied head some checkpoints also store
                    continue
                (target,) = targets
                if target.name in loaded:  # the part's name: flat and prefixed spellings meet
                    raise WeightLoadError(f"checkpoint tensor {name!r} appears more than once")
                if target.part.param is None:
                    shape = tuple(f.get_slice(name).get_shape())
                    if target.part.shape is not None and shape != tuple(target.part.shape):
                        raise WeightLoadError(
                            f"checkpoint tensor {name!r} has shape {shape}, the config implies "
                            f"{tuple(target.part.shape)}"
                        )
                else:
                    wmap.apply(name, f.get_tensor(name), requantize=False)
                loaded.add(target.name)
    if unexpected:
        raise WeightLoadError(
            f"unexpected checkpoint tensors (no matching parameter): {sorted(unexpected)}"
        )
    missing = sorted(wmap.required - loaded)
    if missing:
        raise WeightLoadError(f"checkpoint tensors missing for the model: {missing}")
