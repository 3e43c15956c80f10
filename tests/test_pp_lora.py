"""Multi-LoRA under pipeline parallelism, through `LLM.generate`, against transformers + PEFT
(float32, greedy, CPU, gloo).

TP 1 x PP 2 on the LoRA tests' 2-layer base (`tests.lora_cases`): stage 0 holds layer 0, stage
1 layer 1. Each stage's ranks fill the adapter slots of their own layers' projections and skip
the other stage's tensors (`LoraManager`, like the weight map). Adapter b adapts layer 1 only,
so stage 0 holds none of it; a and c adapt both stages. A mixed batch of the base model and
the three adapters equals PEFT request by request, and again after an adapter is evicted from
its slot (max_loras = 2 < 3 adapters: the slots are reused within the batch's steps).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.lora_cases import BASE_CHECKPOINT, MAX_LORA_RANK, build_adapters, load_base
from tests.moe_cases import hf_greedy
from tests.tp_cases import MAX_MODEL_LEN
from tp_engine import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 5
MIXED = [(None, 9), ("a", 6), ("b", 13), ("c", 5), ("b", 7), (None, 3), ("a", 11)]


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from peft import PeftModel

    from tp_engine.testing import build_random_qwen3

    root = tmp_path_factory.mktemp("pp_lora")
    base = build_random_qwen3(
        root / "base", max_position_embeddings=MAX_MODEL_LEN, **BASE_CHECKPOINT
    )
    adapters = build_adapters(base, root)
    vocab = load_base(base).config.vocab_size
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for _, n in MIXED]
    reference: dict[str | None, list[list[int]]] = {}
    for name in (None, *adapters):
        model = load_base(base)
        if name is not None:
            model = PeftModel.from_pretrained(model, adapters[name]).eval()
        reference[name] = hf_greedy(model, prompts, MAX_TOKENS)
    for name in adapters:  # an adapter that changes nothing would test nothing
        assert reference[name] != reference[None], name
    return {"base": base, "adapters": adapters, "prompts": prompts, "reference": reference}


@pytest.fixture(scope="module")
def llm(case):
    engine = LLM(
        str(case["base"]), tensor_parallel_size=1, pipeline_parallel_size=2, block_size=4,
        num_kv_blocks=96, max_num_seqs=8, max_num_batched_tokens=MAX_MODEL_LEN,
        enable_lora=True, max_lora_rank=MAX_LORA_RANK, max_loras=2, max_cpu_loras=3,
    )  # fmt: skip
    yield engine
    engine.shutdown()


def generate(llm: LLM, case: dict[str, Any], work: list[tuple[int, str | None]]) -> list:
    loras = [
        None
        if name is None
        else LoRARequest(name, "abc".index(name) + 1, str(case["adapters"][name]))
        for _, name in work
    ]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": case["prompts"][i]} for i, _ in work]
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


def test_mixed_batch_equals_peft(llm, case) -> None:
    work = [(i, name) for i, (name, _) in enumerate(MIXED)]
    expected = [case["reference"][name][i] for i, name in work]
    assert generate(llm, case, work) == expected
    # Each adapter alone, b (layer 1 only: stage 1's alone) first.
    for i, name in ((2, "b"), (1, "a"), (3, "c")):
        assert generate(llm, case, [(i, name)]) == [case["reference"][name][i]], name


def test_adapter_of_a_layer_no_stage_holds_is_refused(llm, case, tmp_path) -> None:
    """A key for layer 5 of a 2-layer model is nobody's: refused (on both stages), not skipped
    as another stage's; the engine serves on."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(case["adapters"]["a"], bad)
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    tensors = {k.replace("layers.1.", "layers.5."): v for k, v in tensors.items()}
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    assert json.loads((bad / "adapter_config.json").read_text())["r"] == 4
    with pytest.raises(ValueError, match=r"expected target modules .* 'model\.layers\.5\."):
        llm.engine.add_lora(LoRARequest("bad", 9, str(bad)))  # into a slot on every rank
    assert generate(llm, case, [(0, None)]) == [case["reference"][None][0]]
