"""Multi-LoRA on Qwen3-MoE: two attention adapters and the base model in a mixed batch equal
PEFT at TP = 1 and at TP = 2 with and without expert parallelism. Refused, naming the modules:
what PEFT makes of `gate_proj`/`up_proj`/`down_proj` targets on Qwen3-MoE (it retargets them
to the fused experts, `mlp.experts` and `mlp.experts.base_layer` keys), and a `mlp.gate_proj`
on the sparse layer, which has no such projection (a key the weights file check lets through,
refused by the model on every rank).

The checkpoint is `moe_e8k3_mixed` (`tests.moe_cases`): layers 0, 2 and 3 dense, layer 1
sparse.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rank_worker.tp import TPInfo
from tests.lora_cases import (
    build_adapter,
    lora_reference,
    make_lora_scenario,
    run_lora_ranks,
    run_lora_scenario,
)
from tests.moe_cases import MIN_ROUTER_MARGIN, MOE_CHECKPOINTS, router_margins
from tests.test_lora_layers import ATOL
from tests.tp_cases import MAX_MODEL_LEN

ADAPTERS = {
    "attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "qv": dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"], use_rslora=True),
}
SLOTS = {"attn": 1, "qv": 0}
SEQS = {"base": (None, 7, 0, [1, 2]), "attn": ("attn", 10, 1, [3, 4, 5]),
        "qv": ("qv", 6, 2, [6, 7])}  # fmt: skip
STEPS = [
    [("attn", 9, "all"), ("base", 6, "all"), ("qv", 5, "all")],
    [("base", 1, "all"), ("qv", 1, "all"), ("attn", 1, "all")],
]
_UNSUPPORTED = (
    "While loading {path}, expected target modules in ['q_proj', 'k_proj', 'v_proj', 'o_proj', "
    "'gate_proj', 'up_proj', 'down_proj'] but received {modules}. Please verify that the "
    "loaded LoRA module is correct"
)
REFUSED_MODULES = {
    "experts": ["model.layers.1.mlp.experts", "model.layers.1.mlp.experts.base_layer"],
    "sparse_gate_proj": ["model.layers.1.mlp.gate_proj"],
}


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from tests.lora_cases import load_base
    from tp_engine.testing import build_random_qwen3_moe

    root = tmp_path_factory.mktemp("lora_moe")
    base = build_random_qwen3_moe(
        root / "base", max_position_embeddings=MAX_MODEL_LEN, **MOE_CHECKPOINTS["moe_e8k3_mixed"]
    )
    adapters = {
        name: build_adapter(base, root / name, seed=30 + i, **kwargs)
        for i, (name, kwargs) in enumerate(ADAPTERS.items())
    }
    experts = ["q_proj", "gate_proj", "up_proj", "down_proj"]
    bad = {"experts": build_adapter(base, root / "experts", seed=40, r=4, target_modules=experts)}
    bad["sparse_gate_proj"] = root / "sparse_gate_proj"
    shutil.copytree(adapters["qv"], bad["sparse_gate_proj"])
    weights_file = bad["sparse_gate_proj"] / "adapter_model.safetensors"
    config = AutoConfig.from_pretrained(base)
    prefix = "base_model.model.model.layers.1.mlp.gate_proj"
    extra = {  # shaped as a dense layer's gate_proj would be
        f"{prefix}.lora_A.weight": torch.ones(4, config.hidden_size),
        f"{prefix}.lora_B.weight": torch.ones(config.intermediate_size, 4),
    }
    save_file({**load_file(weights_file), **extra}, weights_file)
    scenario = make_lora_scenario(
        AutoConfig.from_pretrained(base).vocab_size, SLOTS, SEQS, STEPS, seed=3
    )
    from peft import PeftModel

    sequences = [t.tolist() for t in scenario.sequences.values()]
    margins = [router_margins(load_base(base), sequences)] + [
        router_margins(PeftModel.from_pretrained(load_base(base), path).eval(), sequences)
        for path in adapters.values()
    ]
    args = (
        str(base),
        {name: str(p) for name, p in adapters.items()},
        {name: str(p) for name, p in bad.items()},
        [plan.encode() for plan in scenario.plans],
        scenario.slots,
        None,
    )
    return {"args": args, "bad": bad, "margin": min(margins), "scenario": scenario,
            "reference": lora_reference(base, adapters, scenario)}  # fmt: skip


def _check(result: dict[str, Any], case: dict[str, Any]) -> None:
    # A routing flip under fp32 reordering noise would differ by a whole expert, not rounding.
    assert case["margin"] > MIN_ROUTER_MARGIN
    assert result["loads"] == {"attn": True, "qv": True}
    assert result["refusals"] == {
        name: _UNSUPPORTED.format(path=case["bad"][name], modules=modules)
        for name, modules in REFUSED_MODULES.items()
    }
    for step, (logits, ref) in enumerate(zip(result["logits"], case["reference"], strict=True)):
        err = (logits - ref).abs().max().item()
        assert err <= ATOL, f"step {step}: max |diff| {err:.2e}"


def test_moe_mixed_batch_tp1(case: dict[str, Any]) -> None:
    _check(run_lora_scenario(*case["args"], TPInfo(0, 1)), case)


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_moe_mixed_batch_tp2(case: dict[str, Any], tmp_path: Path, ep: bool) -> None:
    first, second = run_lora_ranks(2, case["args"], {"enable_expert_parallel": ep}, tmp_path)
    _check(first, case)
    assert all(x is None for x in second["logits"]) and torch.is_tensor(first["logits"][0])
