"""The Qwen3-MoE model (Qwen3-30B-A3B, Qwen3-235B-A22B), one shard of it per rank.

Qwen3 with sparse MLPs: attention, norms, embedding and LM head are Qwen3's
(`rank_worker.models.qwen3`); in a sparse layer the MLP is a router over `num_experts` experts of
`moe_intermediate_size` features, `num_experts_per_tok` of which run per token
(`rank_worker.models.layers.moe`). Layer i is sparse when it is not in `mlp_only_layers` and
`(i + 1) % decoder_sparse_step == 0` (transformers' rule); the other layers keep a dense MLP of
`intermediate_size`. Either kind of MLP ends in one all-reduce, so a forward pass issues the
same collectives as the dense model.

Experts are tensor-parallel by default (every rank a slice of every expert) or, with
`enable_expert_parallel`, whole experts per rank; see `rank_worker.models.layers.moe` for both and
for why tokens are not sent to their experts' ranks.

Checkpoint names are the published ones: `model.layers.{i}.mlp.gate.weight` (the router) and
`model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`, one tensor per expert and
projection; the experts module names them itself (`FusedMoE.checkpoint_parts`), so the loader
stays generic and as strict as for the dense model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rank_worker.attention.backend import AttentionBackend
from rank_worker.models.layers.moe import Qwen3MoeSparseBlock
from rank_worker.models.model_spec import HeadSpec
from rank_worker.models.qwen3 import Qwen3ForCausalLM, Qwen3MLP
from rank_worker.pp import PipelineStage
from rank_worker.tp import TPInfo


def is_sparse_layer(hf_config: Any, layer: int) -> bool:
    """Whether decoder layer `layer` has the experts (else a dense MLP), as transformers decides."""
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    mlp_only = set(getattr(hf_config, "mlp_only_layers", None) or ())
    return layer not in mlp_only and int(hf_config.num_experts) > 0 and (layer + 1) % step == 0


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """This rank's shard of a Qwen3-MoE causal LM; the same interface as `Qwen3ForCausalLM`
    (`forward`, `compute_logits`, `packed_modules_mapping` for the dense layers and attention).

    `enable_expert_parallel`: whole experts per rank instead of a slice of every expert (of
    the rank's pipeline stage's TP group, under pipeline parallelism). `stage`: as for Qwen3.
    """

    def __init__(
        self,
        hf_config: Any,
        tp: TPInfo,
        dtype: torch.dtype,
        device: torch.device | str,
        attention_backend: AttentionBackend | None = None,
        fused_kernels: bool = False,
        *,
        enable_expert_parallel: bool = False,
        head: HeadSpec | None = None,
        stage: PipelineStage | None = None,
    ) -> None:
        def mlp(layer: int) -> nn.Module:
            kw = dict(dtype=dtype, device=device, fused=fused_kernels)
            if is_sparse_layer(hf_config, layer):
                return Qwen3MoeSparseBlock(
                    hf_config, tp, expert_parallel=enable_expert_parallel, **kw
                )
            return Qwen3MLP(hf_config, tp, **kw)

        super().__init__(
            hf_config, tp, dtype, device, attention_backend, fused_kernels, mlp_factory=mlp,
            head=head, stage=stage,
        )  # fmt: skip
        self.enable_expert_parallel = enable_expert_parallel
