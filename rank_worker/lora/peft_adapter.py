"""PEFT LoRA adapters on disk: what `adapter_config.json` and the tensor names of
`adapter_model.safetensors` say, and whether this runtime can serve them.

Importable on rank 0 without a model (json and the safetensors header only, no tensor read), so
the engine refuses an adapter before any control call; every rank checks again when it loads
(`rank_worker.lora.manager`), against its model. Refusals are `ValueError`s with vLLM's
messages (`vllm/lora/peft_helper.py`, `vllm/lora/models.py`), so a client sees the same text
from either server; a missing adapter is `LoRAAdapterNotFoundError` (vLLM answers it with a
404, the others with a 400).

What is served: LoRA on the seven Qwen3 projections `q/k/v/o_proj` and `gate/up/down_proj` of
any layers (`layers_to_transform` needs nothing: the other layers have no keys), with per-module
ranks and alphas (`rank_pattern`, `alpha_pattern`) and rsLoRA scaling. Refused: DoRA,
`modules_to_save`, biases, ranks above `max_lora_rank`, and every other module, which names
Qwen3-MoE's router (`mlp.gate`) and experts (`mlp.experts.*`) in the message.

PEFT's forward, which the layers reproduce: `y = W x + scaling * B (A x)`, A `[r, in]`,
B `[out, r]`, `scaling = alpha / r` (rsLoRA: `alpha / sqrt(r)`), r and alpha per module.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The HF projections an adapter may target, in the order of our packed layers' parts.
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# `base_model.model.` + the base model's module name (`prefix.proj`) + the LoRA matrix.
_KEY = re.compile(
    r"base_model\.model\.(?P<module>(?P<prefix>model\.layers\.\d+\.(?:self_attn|mlp))\."
    r"(?P<proj>\w+))\.lora_(?P<which>[AB])\.weight"
)
_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_embedding_A", ".lora_embedding_B")


def parse_key(key: str) -> re.Match | None:
    """A PEFT tensor name of a decoder-layer projection, split: `module` (the HF module,
    "model.layers.0.self_attn.q_proj"), its `prefix` and `proj`, and `which` ("A" or "B");
    None for any other name."""
    return _KEY.fullmatch(key)


class LoRAAdapterNotFoundError(ValueError):
    """No adapter (config and safetensors weights) at the path."""


def pattern_key(patterns: Mapping[str, Any], module: str) -> str | None:
    """The first key of `patterns` naming `module` (PEFT's `get_pattern_key`): a regex matching
    a `.`-bounded suffix of the module name, e.g. "down_proj" or "layers.0.mlp.down_proj"."""
    for key in patterns:
        if re.fullmatch(rf"(?:.*\.)?(?:{key})", module):
            return key
    return None


@dataclass(frozen=True)
class LoraConfig:
    """One adapter's serving facts: where it is, its ranks and scalings, its modules."""

    path: str
    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: Mapping[str, int]
    alpha_pattern: Mapping[str, float]
    # The base model's modules the weights file adapts, e.g. "model.layers.0.self_attn.q_proj".
    modules: tuple[str, ...]

    def rank_of(self, module: str) -> int:
        key = pattern_key(self.rank_pattern, module)
        return self.r if key is None else int(self.rank_pattern[key])

    def scaling_of(self, module: str) -> float:
        """PEFT's per-module `scaling`, the factor of `B (A x)`."""
        key = pattern_key(self.alpha_pattern, module)
        alpha = self.lora_alpha if key is None else float(self.alpha_pattern[key])
        r = self.rank_of(module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    @property
    def max_rank(self) -> int:
        return max([self.r, *self.rank_pattern.values()])

    @property
    def weights_file(self) -> Path:
        return Path(self.path) / WEIGHTS_FILE


def read_adapter_config(path: str | Path, max_lora_rank: int) -> LoraConfig:
    """Parse and check the PEFT adapter at `path`; ValueError with vLLM's message if this
    runtime cannot serve it (see the module docstring)."""
    path = str(path)
    config_file, weights_file = Path(path) / CONFIG_FILE, Path(path) / WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise LoRAAdapterNotFoundError(f"No adapter found for {path}")
    try:
        raw = json.loads(config_file.read_text())
        r, keys = int(raw["r"]), _tensor_names(weights_file)
    except Exception as exc:  # a half-written file, a config without `r`, a JSON list...
        raise ValueError(f"Invalid PEFT adapter at {path}: {type(exc).__name__}: {exc}") from exc
    if raw.get("modules_to_save"):
        raise ValueError("vLLM only supports modules_to_save being None.")
    if raw.get("bias", "none") != "none" or raw.get("lora_bias"):
        raise ValueError("Adapter bias is not supported.")
    if raw.get("use_dora"):
        raise ValueError("vLLM does not yet support DoRA.")
    config = LoraConfig(
        path=path,
        r=r,
        lora_alpha=float(raw.get("lora_alpha", 8)),
        use_rslora=bool(raw.get("use_rslora", False)),
        rank_pattern=dict(raw.get("rank_pattern") or {}),
        alpha_pattern=dict(raw.get("alpha_pattern") or {}),
        modules=_adapted_modules(path, keys),
    )
    if config.max_rank > max_lora_rank:
        raise ValueError(
            f"LoRA rank {config.max_rank} is greater than max_lora_rank {max_lora_rank}."
        )
    return config


def _tensor_names(weights_file: Path) -> list[str]:
    """The tensor names in a safetensors file's header (no tensor is read)."""
    from safetensors import safe_open

    with safe_open(str(weights_file), framework="pt") as f:
        return list(f.keys())


def _adapted_modules(path: str, keys: list[str]) -> tuple[str, ...]:
    """The modules the weights file adapts, from its tensor names `keys` (vLLM decides by the
    keys, not by `target_modules`, which may be a regex or "all-linear")."""
    modules, unexpected = set(), set()
    for key in keys:
        if key.endswith(".bias"):
            raise ValueError("Adapter bias is not supported.")
        match = parse_key(key)
        if match is not None and match["proj"] in SUPPORTED_MODULES:
            modules.add(match["module"])
            continue
        name = key.removeprefix("base_model.model.")
        for suffix in _SUFFIXES:
            name = name.removesuffix(suffix)
        unexpected.add(name)
    if unexpected:
        raise unsupported_modules_error(path, sorted(unexpected))
    return tuple(sorted(modules))


def unsupported_modules_error(path: str, modules: list[str]) -> ValueError:
    """vLLM's refusal of modules it has no LoRA layer for (also the model-side refusal of a
    projection the model lacks, e.g. `mlp.gate_proj` of a Qwen3-MoE sparse layer)."""
    return ValueError(
        f"While loading {path}, expected target modules in {list(SUPPORTED_MODULES)} but "
        f"received {modules}. Please verify that the loaded LoRA module is correct"
    )
