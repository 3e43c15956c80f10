"""One rank's adapters: the device slots beside every adapted layer, and a host LRU of parsed
adapters that feeds them.

Ownership: rank 0 decides which adapter sits in which slot (its adapter registry) and tells
every rank through two control calls (`rank_worker.control.lora_ops`): LOAD_LORA puts adapter
`lora_uid` from `path` into slot s, UNLOAD_LORA empties a slot. A rank keeps only what those
calls left: the slot stacks (`LinearLoRA`, device memory allocated once at start-up, before
the KV cache is sized, so the cache budget already leaves them out) and up to
`max_cpu_loras` adapters read from disk, by `lora_uid`, least recently loaded evicted first
(an evicted adapter is read from disk again the next time it is loaded).

A load is two-phase like every control call: `prepare_load` reads (host LRU or disk),
validates against the model (every module must have a LoRA layer, every shape must fit) and
cuts this rank's shards, writing nothing; `commit_load` copies the shards into the slot in
place (CUDA graphs keep the addresses) and zeroes the slot in layers the adapter leaves out.
Under pipeline parallelism a rank has slots on its own stage's layers only and skips the
adapter's tensors for the other stages' layers (their ranks load those); a layer no stage holds
is refused as before.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from rank_worker.lora.layers import AdapterBatch, LinearLoRA
from rank_worker.lora.peft_adapter import (
    LoraConfig,
    parse_key,
    read_adapter_config,
    unsupported_modules_error,
)
from rank_worker.models.layers.linear import _Linear
from rank_worker.runner_config import RunnerConfig

# Unpacked (HF) projections that are their own layer.
_PLAIN = ("o_proj", "down_proj")

# layer module name -> HF projection -> (A [r, in], B [out, r], scaling), full and on the host.
AdapterWeights = dict[str, dict[str, tuple[torch.Tensor, torch.Tensor, float]]]


@dataclass(frozen=True)
class HostAdapter:
    """An adapter read from disk and checked against the model: what the host LRU keeps."""

    config: LoraConfig
    weights: AdapterWeights


@dataclass(frozen=True)
class StagedLoad:
    """What `commit_load` writes: this rank's shard of every adapted layer."""

    slot: int
    lora_uid: Hashable
    adapter: HostAdapter
    shards: dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer name -> (a, b)


def lora_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """`RunnerConfig.lora_dtype` (one of `LORA_DTYPES`: checked there) -> torch dtype ("auto":
    the model's)."""
    return model_dtype if name == "auto" else getattr(torch, name)


class LoraManager:
    """This rank's LoRA slots and host LRU (see the module docstring)."""

    def __init__(
        self, model: torch.nn.Module, config: RunnerConfig, dtype: torch.dtype, use_triton: bool
    ) -> None:
        self.config = config
        self.max_loras = config.max_loras
        device = next(model.parameters()).device
        self.batch = AdapterBatch(
            config.max_num_batched_tokens, device, config.max_loras, grouped=use_triton
        )
        self.layers: dict[str, LinearLoRA] = {}
        # Pipeline parallelism: other stages' layers ("model.layers.3.", ...), whose adapter
        # tensors this rank skips (their stage's ranks load them), as the weight map does.
        self._elsewhere = tuple(getattr(model, "ignored_checkpoint_prefixes", ()))
        # HF projection -> (layer suffix) for packed ones, from the model's own table.
        mapping: dict[str, tuple[str, object]] = getattr(model, "packed_modules_mapping", {})
        self._layer_of = {proj: packed for proj, (packed, _) in mapping.items()}
        self._layer_of.update({proj: proj for proj in _PLAIN})
        projs_of: dict[str, list[str]] = {}
        for proj, layer in self._layer_of.items():
            projs_of.setdefault(layer, []).append(proj)
        for name, module in model.named_modules():
            suffix = name.rsplit(".", 1)[-1]
            if isinstance(module, _Linear) and suffix in projs_of:
                module.lora = self.layers[name] = LinearLoRA(
                    module, tuple(projs_of[suffix]), self.batch,
                    max_loras=config.max_loras, max_rank=config.max_lora_rank,
                    dtype=lora_dtype(config.lora_dtype, dtype), use_triton=use_triton,
                    graph_safe=device.type == "cuda" or config.gpu_data_paths,
                )  # fmt: skip
        self.slot_uids: list[Hashable | None] = [None] * config.max_loras
        self.host: collections.OrderedDict[Hashable, HostAdapter] = collections.OrderedDict()

    @property
    def nbytes(self) -> int:
        """Device bytes of every slot stack."""
        return sum(layer.nbytes for layer in self.layers.values())

    def device_tensors(self) -> list[torch.Tensor]:
        """Every slot stack (A and B of each adapted layer): what sleep mode releases and
        restores beside the weights (`rank_worker.runner.device_sleep`)."""
        return [t for layer in self.layers.values() for t in (layer.a, layer.b)]

    def bind(self, slots: torch.Tensor, any_adapter: bool = True) -> None:
        """The step's `[T]` per-token slots, read by every LoRA layer of its forward
        (`AdapterBatch.bind`)."""
        self.batch.bind(slots, any_adapter)

    def check_slot(self, slot: object) -> int:
        if type(slot) is not int or not 0 <= slot < self.max_loras:
            raise ValueError(f"slot must be an int in [0, {self.max_loras}), got {slot!r}")
        return slot

    # -- loading ---------------------------------------------------------------------------

    def prepare_load(self, slot: int, lora_uid: Hashable, path: str) -> StagedLoad:
        """Read, check and shard; writes nothing. ValueError with vLLM's message on refusal."""
        slot = self.check_slot(slot)
        adapter = self.host.get(lora_uid)
        if adapter is None or adapter.config.path != path:
            adapter = self._read(path)
        shards = {name: self.layers[name].shard(ws) for name, ws in adapter.weights.items()}
        return StagedLoad(slot, lora_uid, adapter, shards)

    def commit_load(self, staged: StagedLoad) -> int:
        """Write the staged shards into the slot; returns the bytes written."""
        for name, layer in self.layers.items():
            layer.write(staged.slot, staged.shards.get(name))
        self.slot_uids[staged.slot] = staged.lora_uid
        self.host[staged.lora_uid] = staged.adapter
        self.host.move_to_end(staged.lora_uid)
        while len(self.host) > self.config.resolved_max_cpu_loras:
            self.host.popitem(last=False)
        return sum(a.nbytes + b.nbytes for a, b in staged.shards.values())

    def unload(self, slot: int, lora_uid: Hashable | None = None) -> None:
        """Zero `slot`; also forget `lora_uid`'s host copy when given."""
        for layer in self.layers.values():
            layer.write(slot, None)
        self.slot_uids[slot] = None
        if lora_uid is not None:
            self.host.pop(lora_uid, None)

    def _read(self, path: str) -> HostAdapter:
        from safetensors.torch import load_file

        config = read_adapter_config(path, self.config.max_lora_rank)
        weights: AdapterWeights = {}
        unknown = []
        tensors = load_file(config.weights_file)
        for key, tensor in tensors.items():
            match = parse_key(key)
            assert match is not None  # read_adapter_config refused any other key
            if match["which"] == "B":
                continue
            module, proj = match["module"], match["proj"]
            layer = f"{match['prefix']}.{self._layer_of[proj]}"
            if layer.startswith(self._elsewhere):
                continue
            if layer not in self.layers:  # a projection this model lacks (a MoE sparse layer)
                unknown.append(module)
                continue
            lora_b = tensors.get(key.replace(".lora_A.", ".lora_B."))
            if lora_b is None:
                raise ValueError(f"{key}: no lora_B beside it in {config.weights_file}")
            weights.setdefault(layer, {})[proj] = (tensor, lora_b, config.scaling_of(module))
        if unknown:
            raise unsupported_modules_error(path, sorted(unknown))
        return HostAdapter(config, weights)


def plan_runs_adapters(plan: Any, lora: LoraManager | None) -> bool:
    """Whether a sequence of `plan` (a `StepPlan`) runs an adapter on a rank with `lora`'s
    slots (None: enable_lora is off). A slot the rank does not have is a ValueError: the plan's
    decoder checks only the lower bound (-1), and the kernels would read past the slot stacks
    (the masked torch path would silently run the base)."""
    slots = plan.section("adapter_slots")
    top = int(slots.max()) if slots.size else -1
    num_slots = 0 if lora is None else lora.max_loras
    if top >= num_slots:
        raise ValueError(
            f"step {plan.step_id}: adapter slot {top}, but this rank has {num_slots} LoRA "
            "slots (max_loras; 0: enable_lora is off)"
        )
    return top >= 0
