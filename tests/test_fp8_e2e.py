"""FP8 checkpoints and the FP8 KV cache end to end: `LLM.generate` greedy against transformers.

The checkpoints are made here (`tests.fp8_cases`): a random bf16 Qwen3 (dense, and MoE),
block-quantized to Qwen's FP8 format, and the reference is transformers in float32 on the
*dequantized* weights. The engine quantizes activations too, so the judge accepts a divergence
only as a near-tie (`NEAR_TIE_NATS`) and reports the measure (the fraction of tokens before the
first divergence, the logprob gap at each divergence) in the test output (`-s -n 0` shows it).

Covered: TP 1, 2, 4 dense; MoE at TP 1, TP 2 (experts sliced into whole blocks) and expert
parallel at 2 and 4 ranks; the refusal of TP 4 for these experts (a slice of 64 features would
split a block); the fp8 KV cache against the model-dtype cache; and a planted error (one
layer's block scales doubled) that the judge must fail, so that it can fail at all. The Triton
path of the same (W8A8 GEMM, fused fp8 MoE, fp8 KV in the attention kernels) runs under the
interpreter in tests/test_fp8_triton_e2e.py.
"""

from __future__ import annotations

import pytest

from tests.fp8_cases import (
    MAX_MODEL_LEN,
    MAX_TOKENS,
    NEAR_TIE_NATS,
    NEAR_TIE_NATS_FP8_KV,
    build_fp8_checkpoints,
    judge,
    load_hf,
    make_prompts,
)
from tp_engine import LLM, SamplingParams

pytestmark = pytest.mark.slow


def generate(model_dir, prompts, max_tokens: int = MAX_TOKENS, **kwargs) -> list[list[int]]:
    llm = LLM(str(model_dir), max_model_len=MAX_MODEL_LEN, num_kv_blocks=64, block_size=4, **kwargs)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=max_tokens),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    ckpts = build_fp8_checkpoints(tmp_path_factory.mktemp("fp8_dense"), moe=False)
    model = load_hf(ckpts.dequantized)
    return ckpts, model, make_prompts(model.config.vocab_size)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    ckpts = build_fp8_checkpoints(tmp_path_factory.mktemp("fp8_moe"), moe=True)
    model = load_hf(ckpts.dequantized)
    return ckpts, model, make_prompts(model.config.vocab_size)


def check(what: str, model, prompts, tokens) -> None:
    agreement = judge(model, prompts, tokens)
    print(agreement.report(what))
    assert agreement.num_tokens >= len(prompts)
    assert agreement.max_gap < NEAR_TIE_NATS, agreement.report(what)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_dense_fp8_matches_dequantized_reference(dense, tp):
    ckpts, model, prompts = dense
    check(
        f"dense fp8 TP {tp}", model, prompts, generate(ckpts.fp8, prompts, tensor_parallel_size=tp)
    )


@pytest.mark.parametrize(("tp", "ep"), [(1, False), (2, False), (2, True), (4, True)])
def test_moe_fp8_matches_dequantized_reference(moe, tp, ep):
    ckpts, model, prompts = moe
    tokens = generate(ckpts.fp8, prompts, tensor_parallel_size=tp, enable_expert_parallel=ep)
    check(f"MoE fp8 TP {tp}{' EP' if ep else ''}", model, prompts, tokens)


def test_moe_fp8_tp4_refuses_to_split_a_block(moe):
    ckpts, _, prompts = moe
    with pytest.raises(Exception, match=r"split a 128×128 block.*FP8"):
        generate(ckpts.fp8, prompts[:1], tensor_parallel_size=4)


def test_fp8_kv_cache_matches_reference(dense):
    """The bf16 source checkpoint, its KV cache in the model dtype and in fp8, each judged
    against transformers on the same weights; the fp8 cache is also compared with the
    model-dtype cache's own tokens."""
    ckpts, _, prompts = dense
    model = load_hf(ckpts.bf16)
    auto = generate(ckpts.bf16, prompts)
    fp8 = generate(ckpts.bf16, prompts, kv_cache_dtype="fp8")
    check("model-dtype KV cache", model, prompts, auto)
    check("fp8 KV cache", model, prompts, fp8)
    equal = [a == b for x, y in zip(auto, fp8, strict=True) for a, b in zip(x, y, strict=False)]
    print(f"fp8 KV vs model-dtype KV: {sum(equal)} of {len(equal)} tokens equal")


def test_fp8_kv_cache_with_fp8_weights_tp2(dense):
    ckpts, model, prompts = dense
    tokens = generate(ckpts.fp8, prompts, tensor_parallel_size=2, kv_cache_dtype="fp8")
    agreement = judge(model, prompts, tokens)
    print(agreement.report("dense fp8 weights + fp8 KV TP 2"))
    assert agreement.max_gap < NEAR_TIE_NATS_FP8_KV


def test_judge_fails_a_planted_scale_error(dense, tmp_path):
    """Layer 0's o_proj scales doubled: the engine's outputs must be judged wrong."""
    from safetensors.torch import load_file, save_file

    ckpts, model, prompts = dense
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in ckpts.fp8.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = load_file(broken / "model.safetensors")
    for name in ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"):
        weights[f"{name}.weight_scale_inv"] *= 4.0
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    agreement = judge(model, prompts, generate(broken, prompts))
    print(agreement.report("planted error"))
    assert agreement.max_gap > 2 * NEAR_TIE_NATS_FP8_KV
    assert agreement.fraction_before_first_divergence < 0.5
