"""One map from Hugging Face tensor names to this rank's parameter storage, for checkpoint
loading and for run-time weight updates alike.

Built once per runner from the module tree (`WeightMap(model)`); it holds no weights, only
rules. Who uses it: `rank_worker.models.loader.load_checkpoint` (strict: every required name exactly
once, from safetensors files) and run-time updates (`prepare` then `commit`: any subset of
names, full tensors of any float dtype, the whole batch validated before the first write).

The name rules, all here and nowhere else:
- a parameter's own name (norms, embedding, o_proj, down_proj, the MoE router, LM head);
- packed parameters: `q/k/v_proj` → `qkv_proj` and `gate/up_proj` → `gate_up_proj` part by
  part (`model.packed_modules_mapping`), their `weight_scale_inv` likewise;
- names a module gives itself (`checkpoint_parts`): MoE experts, one tensor per expert and
  projection, including experts another rank holds under expert parallelism (only their shape
  is checked), and the optional KV-cache scales;
- ignored: the derived rotary table (`rotary_emb.inv_freq`), `lm_head.weight` of a tied
  model (the embedding is the head; `state_dict()` lists the tie twice), and the tensors of a
  head the model does not build (`model.ignored_checkpoint_names`: an LM head served as an
  embedder);
- pipeline parallelism: the tensors other stages hold (`model.ignored_checkpoint_prefixes`:
  their layers, the embedding, the final norm, the LM head), skipped unread; and a tied LM head
  on a last stage without the embedding, loaded from `model.embed_tokens.weight`
  (`model.checkpoint_aliases`);
- the flat layout of headless checkpoints (Qwen3-Embedding as published: `embed_tokens.weight`,
  `layers.N...`, `norm.weight`, without the `model.` prefix) names the same parameters;
- run-time only: transformers 5's in-memory expert layout, `mlp.experts.gate_up_proj`
  `[E, 2I, H]` (each expert's gate rows, then its up rows) and `mlp.experts.down_proj`
  `[E, H, I]`, split into the per-expert parts. Published checkpoints never store it, so the
  loader refuses it there.

How a full tensor is cut into this rank's shard stays with each parameter's `weight_loader`
(the layer knows its split: vocabulary padding, replicated KV heads, FP8 block scales).
Checking without writing runs that same loader against a shape-only copy of the parameter on
the meta device: the same checks raise the same errors, and every `copy_` lands nowhere. So the
shard geometry is written once, in the layers, and validation cannot drift from it.

FP8 models: a weight whose checkpoint name has a `weight_scale_inv` partner is quantized. An
update may send it already in fp8 together with its scale, or in any other float dtype; then it
is block-quantized here exactly as `tp_engine.testing.quantize_checkpoint_fp8` makes an FP8
checkpoint (`kernels.fp8_gemm.quantize_block_fp8` of the full tensor), so the result equals a
fresh load of that checkpoint bit for bit. Every rule that decides whether a batch is valid
reads names and full shapes only, never which parameters this rank holds, so every rank of a
TP group reaches the same verdict on the same batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from rank_worker.models.layers.moe import FusedMoE
from rank_worker.models.layers.params import CheckpointPart
from rank_worker.models.quantization import FP8_DTYPE, scale_shape

# Checkpoint tensors that are derived, not learnt: older exports saved the rotary table.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
SCALE_SUFFIX = "_scale_inv"
# The decoder body's module name; headless checkpoints leave it out of their tensor names.
_BODY_PREFIX = "model."


class WeightLoadError(ValueError):
    """The checkpoint does not match the model: a missing, unexpected or duplicated tensor."""


class Target(NamedTuple):
    """One checkpoint part that an incoming tensor fills."""

    name: str  # the part's checkpoint name; a fused expert tensor's parts have their own
    part: CheckpointPart  # `param` is the full parameter name, None for another rank's expert
    select: tuple[int | slice, ...] = ()  # the part inside the incoming tensor: [expert, rows]


class _Fused(NamedTuple):
    shape: tuple[int, ...]  # the whole fused tensor, [E, 2I, H] or [E, H, I]
    targets: list[Target]


def expected_parts(model: nn.Module) -> dict[str, CheckpointPart]:
    """Every part a checkpoint must provide, keyed by checkpoint tensor name; `param` is the
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


class WeightMap:
    """Hugging Face names → this rank's shards of `model`'s parameters (see the module
    docstring). `resolve` says where a name goes, `check` whether a tensor of that shape and
    dtype would fit (no writes), `apply` copies this rank's shard into the existing storage
    (every parameter keeps its `data_ptr`, so captured CUDA graphs stay valid); `prepare` and
    `commit` do the same for a whole batch."""

    def __init__(self, model: nn.Module) -> None:
        self._params = dict(model.named_parameters())
        self.parts = expected_parts(model)
        self.required = frozenset(name for name, part in self.parts.items() if not part.optional)
        self._ignored = frozenset(getattr(model, "ignored_checkpoint_names", ()))
        if getattr(model, "tie_word_embeddings", False):
            self._ignored |= {"lm_head.weight"}
        # Pipeline parallelism (module docstring): other stages' tensors, and name aliases.
        self._elsewhere = tuple(getattr(model, "ignored_checkpoint_prefixes", ()))
        self._aliases: dict[str, str] = dict(getattr(model, "checkpoint_aliases", {}))
        self._fused: dict[str, _Fused] = {}
        for prefix, module in model.named_modules():
            if isinstance(module, FusedMoE):
                self._fused.update(self._fused_names(prefix, module))

    def _fused_names(self, prefix: str, moe: FusedMoE) -> dict[str, _Fused]:
        num, inter = moe.placement.num_experts, moe.placement.intermediate_size
        hidden = moe.hidden_size

        def target(expert: int, proj: str, *rows: slice) -> Target:
            name = f"{prefix}.{expert}.{proj}_proj.weight"
            return Target(name, self.parts[name], (expert, *rows))

        gate_up = [
            target(e, proj, rows)
            for e in range(num)
            for proj, rows in (("gate", slice(0, inter)), ("up", slice(inter, 2 * inter)))
        ]
        down = [target(e, "down") for e in range(num)]
        return {
            f"{prefix}.gate_up_proj": _Fused((num, 2 * inter, hidden), gate_up),
            f"{prefix}.down_proj": _Fused((num, hidden, inter), down),
        }

    def resolve(self, name: str, *, fused: bool = True) -> list[Target] | None:
        """The parts `name` fills: None for a name the model does not know, [] for one it
        ignores. `fused=False` treats transformers 5's fused expert names as unknown (a
        checkpoint on disk)."""
        if name.endswith(IGNORED_SUFFIXES) or name in self._ignored:
            return []
        name = self._aliases.get(name, name)
        part = self.parts.get(name)
        if part is None and not name.startswith(_BODY_PREFIX):
            if name.startswith(self._elsewhere):
                return []
            name = _BODY_PREFIX + name  # the flat layout (module docstring)
            name = self._aliases.get(name, name)
            part = self.parts.get(name)
        if part is not None:
            return [Target(name, part)]
        if name.startswith(self._elsewhere):
            return []
        if fused and name in self._fused:
            return self._fused[name].targets
        return None

    def held_elsewhere(self, name: str) -> bool:
        """Whether `name` is a tensor another pipeline stage holds (`resolve` gives [] for it,
        as for an ignored one): this rank skips it, the stage that holds it writes or reads it."""
        ignored = name.endswith(IGNORED_SUFFIXES) or name in self._ignored
        return not ignored and self.resolve(name) == []

    def covers(self, names: Iterable[str]) -> bool:
        """Whether tensors named `names` fill every part this rank must hold (`required`)."""
        filled = {target.name for name in names for target in self.resolve(name) or ()}
        return self.required <= filled

    def is_quantized(self, name: str) -> bool:
        """Whether checkpoint weight `name` is fp8 in this model (it has a scale partner)."""
        return name + SCALE_SUFFIX in self.parts

    def check(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> str | None:
        """None when a full tensor `name` of `shape` and `dtype` fits the model, else why not,
        naming the tensor (and both shapes when they differ). Writes nothing."""
        return self._check(name, torch.empty(tuple(shape), dtype=dtype, device="meta"))

    def _check(self, name: str, full: torch.Tensor) -> str | None:
        """`check` of a tensor: a meta one, or a real one whose values some loaders check (a
        KV-cache scale must be positive)."""
        targets = self.resolve(name)
        if targets is None:
            return f"{name!r}: no weight of that name in the model"
        if not full.dtype.is_floating_point:
            return f"{name!r}: dtype {full.dtype} is not a floating-point type"
        fused = self._fused.get(name)
        if fused is not None:
            if tuple(full.shape) != fused.shape:
                return f"{name!r}: shape {tuple(full.shape)}, the model expects {fused.shape}"
            if full.dtype == FP8_DTYPE:
                return (
                    f"{name!r}: fused fp8 expert tensors have no scale names; send them in a "
                    "float dtype or as per-expert tensors with their weight_scale_inv"
                )
        for target in targets:
            error = self._dry_run(target, full[target.select])
            if error is not None:
                return f"{name!r}: {error}"
        return None

    def _dry_run(self, target: Target, full: torch.Tensor) -> str | None:
        """Why `target` cannot take `full`, from its loader run against shape-only tensors."""
        if full.dtype == FP8_DTYPE and not self.is_quantized(target.name):
            return "float8_e4m3fn given for a tensor the model does not keep in fp8"
        part = target.part
        if part.param is None:  # another rank's expert: its shape is all there is to check
            if part.shape is not None and tuple(full.shape) != tuple(part.shape):
                return f"shape {tuple(full.shape)}, the config implies {tuple(part.shape)}"
            return None
        try:
            if self._requantizes(target, full):
                self._load_into_meta(part, torch.empty(full.shape, dtype=FP8_DTYPE, device="meta"))
                scale = self._scale_target(target)
                self._load_into_meta(
                    scale.part, torch.empty(scale_shape(*full.shape), device="meta")
                )
            else:
                self._load_into_meta(part, full)
        except (ValueError, RuntimeError) as e:
            return str(e)
        return None

    def _load_into_meta(self, part: CheckpointPart, full: torch.Tensor) -> None:
        param = self._params[part.param]
        shape_only = torch.empty_like(param, device="meta")
        param.weight_loader(shape_only, full, part.shard_id)  # type: ignore[attr-defined]

    def _requantizes(self, target: Target, full: torch.Tensor) -> bool:
        return full.dtype != FP8_DTYPE and self.is_quantized(target.name)

    def _scale_target(self, target: Target) -> Target:
        name = target.name + SCALE_SUFFIX
        return Target(name, self.parts[name])

    def apply(self, name: str, tensor: torch.Tensor, *, requantize: bool = True) -> None:
        """Copy this rank's shard of full tensor `name` into the model, in place. A float
        tensor for an fp8 weight is block-quantized first and fills the scale too, unless
        `requantize=False` (a checkpoint, which must store what the model keeps). Raises
        `WeightLoadError` naming the tensor; `check` first to refuse before any write."""
        targets = self.resolve(name)
        if targets is None:
            raise WeightLoadError(f"{name!r}: no weight of that name in the model")
        for target in targets:
            full = tensor[target.select]
            if target.part.param is None:
                continue
            if requantize and self._requantizes(target, full):
                from kernels.fp8_gemm import quantize_block_fp8

                weight, scale = quantize_block_fp8(full)
                self._load(target, weight)
                self._load(self._scale_target(target), scale)
            else:
                self._load(target, full)

    def _load(self, target: Target, full: torch.Tensor) -> None:
        param = self._params[target.part.param]
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            raise WeightLoadError(f"parameter {target.part.param!r} has no weight_loader")
        try:
            loader(param, full, target.part.shard_id)
        except ValueError as e:
            raise WeightLoadError(
                f"cannot load {target.name!r} into {target.part.param!r}: {e}"
            ) from e

    def prepare(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Every reason the batch `named` (full tensors) cannot be applied; [] when `commit`
        may write it all. Writes nothing. Beyond `check` per tensor: no part twice (a fused
        expert tensor and a per-expert one overlap), and an fp8 weight comes with its scale
        (a float one is requantized, so a scale beside it would contradict it)."""
        errors: list[str] = []
        given: dict[str, tuple[str, torch.dtype]] = {}  # part name -> (incoming name, dtype)
        for name, tensor in named:
            error = self._check(name, tensor)
            if error is not None:
                errors.append(error)
                continue
            for target in self.resolve(name) or []:
                if target.name in given:
                    errors.append(f"{name!r}: {target.name!r} is given more than once")
                given[target.name] = (name, tensor.dtype)
        for part_name, (name, dtype) in given.items():
            if part_name.endswith(SCALE_SUFFIX):
                weight = given.get(part_name.removesuffix(SCALE_SUFFIX))
                if weight is None or weight[1] != FP8_DTYPE:
                    errors.append(
                        f"{name!r}: a weight_scale_inv needs its weight in fp8 in the same "
                        "update (a float weight is requantized and brings its own scale)"
                    )
            elif dtype == FP8_DTYPE and part_name + SCALE_SUFFIX not in given:
                errors.append(
                    f"{name!r}: an fp8 weight needs its {part_name + SCALE_SUFFIX!r} in the "
                    "same update"
                )
        return errors

    def commit(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write a batch that `prepare` accepted."""
        for name, tensor in named:
            self.apply(name, tensor)

    def update(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """`prepare` then, when it found nothing wrong, `commit`: all of the batch or none of
        it. Returns `prepare`'s errors."""
        batch = list(named)
        errors = self.prepare(batch)
        if not errors:
            self.commit(batch)
        return errors
