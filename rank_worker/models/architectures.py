"""Which model class serves a checkpoint, from its config.json.

`architectures` names the class (as transformers reads it); a config without a known one falls
back to its `model_type`. Anything else is refused here, with the names that are supported,
rather than by the loader as a list of unexpected tensors.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from rank_worker.attention.backend import AttentionBackend
from rank_worker.models.model_spec import HeadSpec
from rank_worker.models.qwen3 import Qwen3ForCausalLM
from rank_worker.models.qwen3_moe import Qwen3MoeForCausalLM
from rank_worker.pp import PipelineStage
from rank_worker.tp import TPInfo

logger = logging.getLogger(__name__)

# The body is the same whatever the head (`rank_worker.models.model_spec` picks it): a seq-cls
# checkpoint, and sentence-transformers 6's re-save of an embedder (`Qwen3Model`), are Qwen3.
_BY_ARCHITECTURE: dict[str, type[nn.Module]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3ForSequenceClassification": Qwen3ForCausalLM,
    "Qwen3Model": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}
_BY_MODEL_TYPE: dict[str, type[nn.Module]] = {
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}


def model_class_for(hf_config: Any) -> type[nn.Module]:
    """The class for `hf_config`; ValueError naming what is supported when none fits."""
    architectures = list(getattr(hf_config, "architectures", None) or ())
    for name in architectures:
        if name in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[name]
    model_type = getattr(hf_config, "model_type", None)
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    raise ValueError(
        f"unsupported model: architectures {architectures}, model_type {model_type!r}; "
        f"supported architectures: {sorted(_BY_ARCHITECTURE)}"
    )


def is_moe(hf_config: Any) -> bool:
    return model_class_for(hf_config) is Qwen3MoeForCausalLM


def build_model(
    hf_config: Any,
    tp: TPInfo,
    dtype: torch.dtype,
    device: torch.device | str,
    attention_backend: AttentionBackend | None = None,
    *,
    fused_kernels: bool = False,
    enable_expert_parallel: bool = False,
    head: HeadSpec | None = None,
    stage: PipelineStage | None = None,
) -> nn.Module:
    """This rank's shard of the checkpoint's model, weights not loaded yet; `head`: its output
    head (None: the LM head); `stage`: its pipeline stage's layers (None: all of them)."""
    cls = model_class_for(hf_config)
    if cls is Qwen3MoeForCausalLM:
        return Qwen3MoeForCausalLM(
            hf_config, tp, dtype, device, attention_backend, fused_kernels,
            enable_expert_parallel=enable_expert_parallel, head=head, stage=stage,
        )  # fmt: skip
    if enable_expert_parallel and tp.is_first:
        logger.warning("enable_expert_parallel has no effect: the model has no experts")
    return cls(
        hf_config, tp, dtype, device, attention_backend, fused_kernels, head=head, stage=stage
    )
