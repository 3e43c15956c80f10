"""EAGLE-3 draft heads on disk: the two published layouts, read into one description, and every
way a head can fail to fit its target refused by name before anything loads.

Layouts (`/work/shared/research/eagle3-format.md` has the sources):

| | SpecForge / SGLang (`LlamaForCausalLMEagle3`) | vLLM speculators (`Eagle3Speculator`) |
| --- | --- | --- |
| config | a flat Llama config + `draft_vocab_size` | `transformer_layer_config` (Llama or Qwen3) + `draft_vocab_size`, `norm_before_residual`, `target_hidden_size`, `eagle_aux_hidden_state_layer_ids` |
| layer tensors | `midlayer.*` | `layers.0.*` |
| aux layer ids | outputs of layer i (SGLang captures the input of i + 1) | inputs of layer i (vLLM) |
| default ids | none given: inputs of layers (2, L // 2, L - 3) in both runtimes | same |

Both carry `fc.weight [H, 3 * Ht]`, `norm.weight`, `lm_head.weight [draft_vocab, H]`, `d2t
[draft_vocab]` (target id = draft id + d2t[draft id]) and optionally `t2d` and
`embed_tokens.weight` (unused: the head embeds with the target's table, as SGLang always does
and as SpecForge trains it, with a frozen copy of that table).

Layer selection is kept as `capture_layers`: indices into Hugging Face's `output_hidden_states`
tuple (0 = the embedding output, i = the input of decoder layer i = the output of layer i - 1),
the residual stream before any norm. SGLang's ids are +1 here, vLLM's as they are; the two
runtimes disagree on pinned ids, so each layout keeps its own runtime's reading.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

# Canonical tensor names (the SpecForge layout) -> the shape rule checked at start. H: the
# head's hidden size, I: its intermediate size, q/kv: heads * head_dim, Vd: the draft vocab.
LAYER_TENSORS = (
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight",
)
HEAD_TENSORS = ("fc.weight", "norm.weight", "lm_head.weight", "d2t")
# Present in some exports, never read (see the module docstring).
UNUSED_TENSORS = ("t2d", "embed_tokens.weight")
# Config switches of variants this head does not implement: refused by name, not ignored.
_UNSUPPORTED_SWITCHES = ("fc_norm", "norm_before_fc", "norm_output")


@dataclass(frozen=True)
class Eagle3HeadConfig:
    """One EAGLE-3 head, whichever layout it came in."""

    layout: str  # "specforge" or "speculators"
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    draft_vocab_size: int
    # Hugging Face `output_hidden_states` indices of the three states fed to fc, in order.
    capture_layers: tuple[int, int, int]
    # speculators' `norm_before_residual`: the layer's residual is hidden_norm(h), not h.
    norm_before_residual: bool
    # Checkpoint name -> canonical name (`LAYER_TENSORS`, `HEAD_TENSORS`).
    tensor_names: tuple[tuple[str, str], ...]

    def to_dict(self) -> dict[str, Any]:
        """What travels to the other ranks in the bootstrap message (plain JSON types)."""
        return {
            **{k: getattr(self, k) for k in self.__dataclass_fields__ if k != "tensor_names"},
            "capture_layers": list(self.capture_layers),
            "tensor_names": [list(pair) for pair in self.tensor_names],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Eagle3HeadConfig:
        return cls(
            **{
                **data,
                "capture_layers": tuple(data["capture_layers"]),
                "tensor_names": tuple(tuple(pair) for pair in data["tensor_names"]),
            }
        )


def default_capture_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's and SGLang's default for every target: the inputs of layers 2, L/2 and L-3
    (SpecForge's layer outputs 1, L/2 - 1, L - 4)."""
    return (2, num_layers // 2, num_layers - 3)


def read_eagle3_config(head_dir: str | Path, target: Any) -> Eagle3HeadConfig:
    """The head in `head_dir` for the target whose transformers config is `target`; ValueError
    naming the key or tensor that does not fit (checked from config.json and the safetensors
    headers only: nothing is loaded)."""
    path = Path(head_dir)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"speculative_config: the EAGLE-3 head {str(path)!r} has no config.json")
    raw = json.loads(cfg_file.read_text())
    if raw.get("speculators_model_type") is not None or "transformer_layer_config" in raw:
        layout, layer, ids_are_outputs = "speculators", raw.get("transformer_layer_config"), False
        if raw.get("speculators_model_type") != "eagle3":
            raise ValueError(
                f"EAGLE-3 head {path}: speculators_model_type is "
                f"{raw.get('speculators_model_type')!r}, not 'eagle3'"
            )
        if not isinstance(layer, dict):
            raise ValueError(f"EAGLE-3 head {path}: transformer_layer_config is missing")
        pinned = raw.get("eagle_aux_hidden_state_layer_ids")
        # vLLM reads a missing flag as true for speculators configs (the research notes).
        norm_before_residual = bool(raw.get("norm_before_residual", True))
        switches = raw
    else:
        layout, layer, ids_are_outputs = "specforge", raw, True
        archs = raw.get("architectures") or []
        if "LlamaForCausalLMEagle3" not in archs:
            raise ValueError(
                f"EAGLE-3 head {path}: architectures {archs!r} name neither "
                "LlamaForCausalLMEagle3 (SpecForge/SGLang) nor a speculators eagle3 config"
            )
        eagle = raw.get("eagle_config") or {}
        pinned = raw.get(
            "eagle_aux_hidden_state_layer_ids", eagle.get("eagle_aux_hidden_state_layer_ids")
        )
        norm_before_residual = False
        switches = raw
    for key in _UNSUPPORTED_SWITCHES:
        if switches.get(key):
            raise ValueError(
                f"EAGLE-3 head {path}: {key!r} (an EAGLE 3.1 variant) is not supported"
            )
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"EAGLE-3 head {path}: num_hidden_layers must be 1")
    hidden = _int(layer, "hidden_size", path)
    heads = _int(layer, "num_attention_heads", path)
    cfg = Eagle3HeadConfig(
        layout=layout,
        hidden_size=hidden,
        intermediate_size=_int(layer, "intermediate_size", path),
        num_heads=heads,
        num_kv_heads=int(layer.get("num_key_value_heads", heads)),
        head_dim=int(layer.get("head_dim") or hidden // heads),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=float(layer.get("rope_theta", 10000.0)),
        max_position_embeddings=int(layer.get("max_position_embeddings", 2048)),
        draft_vocab_size=int(raw.get("draft_vocab_size") or layer.get("vocab_size") or 0),
        capture_layers=_capture_layers(
            pinned, ids_are_outputs, int(target.num_hidden_layers), path
        ),
        norm_before_residual=norm_before_residual,
        tensor_names=(),
    )
    _check_against_target(cfg, raw, layer, target, path)
    names = _tensor_names(path, layout)
    cfg = Eagle3HeadConfig(**{**cfg.__dict__, "tensor_names": tuple(sorted(names.items()))})
    _check_shapes(cfg, path, _shapes(path, names))
    _check_d2t(cfg, path, int(target.vocab_size))
    return cfg


def _int(d: dict[str, Any], key: str, path: Path) -> int:
    if not isinstance(d.get(key), int):
        raise ValueError(f"EAGLE-3 head {path}: config key {key!r} is missing or not an integer")
    return int(d[key])


def _capture_layers(
    pinned: Any, ids_are_outputs: bool, num_layers: int, path: Path
) -> tuple[int, int, int]:
    if pinned is None:
        layers = default_capture_layers(num_layers)
        if min(layers) < 0:
            raise ValueError(
                f"EAGLE-3 head {path}: the default aux layers {layers} need a target of at "
                f"least 3 layers, it has {num_layers}"
            )
        return layers
    if not (
        isinstance(pinned, list) and len(pinned) == 3 and all(isinstance(i, int) for i in pinned)
    ):
        raise ValueError(
            f"EAGLE-3 head {path}: eagle_aux_hidden_state_layer_ids must be three layer ids, "
            f"got {pinned!r}"
        )
    bad = [i for i in pinned if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"EAGLE-3 head {path}: eagle_aux_hidden_state_layer_ids {pinned} name layers "
            f"{bad} beyond the target's {num_layers} (0..{num_layers - 1})"
        )
    shift = 1 if ids_are_outputs else 0
    return (pinned[0] + shift, pinned[1] + shift, pinned[2] + shift)


def _check_against_target(
    cfg: Eagle3HeadConfig, raw: dict[str, Any], layer: dict[str, Any], target: Any, path: Path
) -> None:
    target_hidden = int(target.hidden_size)
    declared = raw.get("target_hidden_size") or layer.get("target_hidden_size")
    if declared is not None and int(declared) != target_hidden:
        raise ValueError(
            f"EAGLE-3 head {path}: target_hidden_size {declared} is not the target's hidden "
            f"size {target_hidden}"
        )
    if cfg.hidden_size != target_hidden:
        raise ValueError(
            f"EAGLE-3 head {path}: hidden_size {cfg.hidden_size} differs from the target's "
            f"{target_hidden} (a narrower head embeds with its own table: not supported)"
        )
    vocab = layer.get("vocab_size")
    if vocab is not None and int(vocab) != int(target.vocab_size):
        raise ValueError(
            f"EAGLE-3 head {path}: vocab_size {vocab} differs from the target's {target.vocab_size}"
        )
    if not 0 < cfg.draft_vocab_size <= int(target.vocab_size):
        raise ValueError(
            f"EAGLE-3 head {path}: draft_vocab_size {cfg.draft_vocab_size} must be in "
            f"1..{target.vocab_size} (the target's vocabulary)"
        )
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(
            f"EAGLE-3 head {path}: num_attention_heads {cfg.num_heads} is not a multiple of "
            f"num_key_value_heads {cfg.num_kv_heads}"
        )


def _tensor_names(path: Path, layout: str) -> dict[str, str]:
    """Checkpoint name -> canonical name for every tensor in the head's files; refuses a
    tensor with no place."""
    known = set(LAYER_TENSORS) | set(HEAD_TENSORS) | set(UNUSED_TENSORS)
    names: dict[str, str] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open has no __iter__)
                canon = name.removeprefix("model.")
                if layout == "speculators" and canon.startswith("layers.0."):
                    canon = "midlayer." + canon.removeprefix("layers.0.")
                if canon not in known:
                    raise ValueError(
                        f"EAGLE-3 head {path}: tensor {name!r} has no place in the head"
                    )
                names[f"{file.name}:{name}"] = canon
    if not names:
        raise ValueError(f"EAGLE-3 head {path}: no *.safetensors files")
    missing = [m for m in LAYER_TENSORS + HEAD_TENSORS if m not in set(names.values())]
    if missing:
        raise ValueError(f"EAGLE-3 head {path}: tensors {missing} are missing")
    return names


def _shapes(path: Path, names: dict[str, str]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for key, canon in names.items():
        file, name = key.split(":", 1)
        with safe_open(str(path / file), framework="pt") as f:
            shapes[canon] = tuple(f.get_slice(name).get_shape())
    return shapes


def _check_shapes(cfg: Eagle3HeadConfig, path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    h, i, vd = cfg.hidden_size, cfg.intermediate_size, cfg.draft_vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    expected = {
        "fc.weight": (h, 3 * h),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (vd, h),
        "d2t": (vd,),
    }
    why = {
        "fc.weight": "fc reads the three target states: [hidden_size, 3 x the target's hidden size]",
        "lm_head.weight": "one row per draft token (draft_vocab_size)",
        "d2t": "one offset per draft token (draft_vocab_size)",
    }
    for name, want in expected.items():
        if shapes[name] != want:
            raise ValueError(
                f"EAGLE-3 head {path}: tensor {name!r} has shape {list(shapes[name])}, expected "
                f"{list(want)}" + (f" ({why[name]})" if name in why else "")
            )


def _check_d2t(cfg: Eagle3HeadConfig, path: Path, vocab_size: int) -> None:
    """Every draft id must map into the target's vocabulary (else the head would propose ids
    the target has no row for)."""
    import torch

    d2t = _read_one(path, cfg, "d2t")
    target_ids = torch.arange(d2t.numel()) + d2t.long()
    bad = torch.nonzero((target_ids < 0) | (target_ids >= vocab_size)).flatten()
    if bad.numel():
        raise ValueError(
            f"EAGLE-3 head {path}: tensor 'd2t' maps draft id {int(bad[0])} to "
            f"{int(target_ids[bad[0]])}, outside the target's vocabulary of {vocab_size}"
        )


def _read_one(path: Path, cfg: Eagle3HeadConfig, canon: str) -> Any:
    key = next(k for k, c in cfg.tensor_names if c == canon)
    file, name = key.split(":", 1)
    with safe_open(str(path / file), framework="pt") as f:
        return f.get_tensor(name)


def load_eagle3_tensors(head_dir: str | Path, cfg: Eagle3HeadConfig) -> dict[str, Any]:
    """The head's tensors by canonical name (CPU; the unused ones left out)."""
    path = Path(head_dir)
    out: dict[str, Any] = {}
    for key, canon in cfg.tensor_names:
        if canon in UNUSED_TENSORS:
            continue
        file, name = key.split(":", 1)
        with safe_open(str(path / file), framework="pt") as f:
            out[canon] = f.get_tensor(name)
    return out
