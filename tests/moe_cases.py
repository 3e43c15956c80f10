"""Tiny random Qwen3-MoE checkpoints for the MoE tests, and the router margins they rely on.

Two checkpoints, chosen to cover between them: every layer sparse and some layers dense
(`decoder_sparse_step` 2, and an `mlp_only_layers` entry that overrides a layer the step would
make sparse); `norm_topk_prob` on and off; expert counts the ranks divide (8 over 2 and 4) and
do not (6 over 4 ranks: 2, 2, 1, 1 experts under expert parallelism); an expert width that
splits evenly over 4 ranks (tensor parallelism); tied and untied heads; 1 and 2 KV heads.

Why margins. Tensor-parallel runs reorder fp32 sums, which moves activations by ~1e-6; a token
whose k-th and (k+1)-th router scores are closer than that could take a different expert at a
different TP size, and then its output differs by a whole expert's contribution, not by
rounding. The builder makes router logits sharp (`ROUTER_SCALE`), and `router_margins`
measures, on transformers' own forward over the very tokens a test runs, the smallest gap
between the last chosen and the first unchosen expert; the tests assert it is far above 1e-6
so that a routing flip cannot be what they see.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.tp_cases import MAX_MODEL_LEN

# name -> build_random_qwen3_moe arguments.
MOE_CHECKPOINTS: dict[str, dict[str, Any]] = {
    # All layers sparse; 6 experts: not divisible by 4 ranks.
    "moe_e6k2": dict(
        hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
        tie_word_embeddings=False, seed=21,
    ),
    # Layers 0 and 2 dense by the step, 3 dense by mlp_only_layers: only layer 1 is sparse.
    "moe_e8k3_mixed": dict(
        hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=1, head_dim=8,
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, norm_topk_prob=False,
        decoder_sparse_step=2, mlp_only_layers=[3], intermediate_size=48,
        tie_word_embeddings=True, seed=22,
    ),
}  # fmt: skip
# Smallest acceptable gap between the k-th and (k+1)-th router logit (the logits have standard
# deviation ROUTER_SCALE = 4): three orders of magnitude above fp32 reordering noise.
MIN_ROUTER_MARGIN = 1e-3


def build_moe_checkpoints(root: Path) -> dict[str, Path]:
    from tp_engine.testing import build_random_qwen3_moe

    return {
        name: build_random_qwen3_moe(root / name, max_position_embeddings=MAX_MODEL_LEN, **kwargs)
        for name, kwargs in MOE_CHECKPOINTS.items()
    }


def load_hf_moe(model_dir: Path) -> Any:
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def router_margins(model: Any, sequences: list[list[int]]) -> float:
    """The smallest gap, over every token of every sequence and every sparse layer, between the
    k-th and the (k+1)-th largest router logit in transformers' forward."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    gaps: list[torch.Tensor] = []

    def hook(module: Any, _inputs: Any, output: Any) -> None:
        logits = output[0]  # [tokens, E]
        top = torch.topk(logits.float(), module.top_k + 1, dim=-1).values
        gaps.append(top[:, -2] - top[:, -1])

    routers = [m for m in model.modules() if isinstance(m, Qwen3MoeTopKRouter)]
    assert routers, "no sparse layer in the model"
    handles = [m.register_forward_hook(hook) for m in routers]
    try:
        with torch.no_grad():
            for seq in sequences:
                model(torch.tensor([seq]))
    finally:
        for h in handles:
            h.remove()
    return float(torch.cat(gaps).min())


def hf_greedy(model: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuations, recomputing the whole sequence at every token."""
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            outs.append(ids[len(prompt) :])
    return outs
