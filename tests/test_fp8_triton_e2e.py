"""The FP8 Triton path end to end under the interpreter (CPU): the W8A8 block GEMM in every
linear layer, the fused MoE with fp8 experts, and the fp8 KV cache written by the q/k norm +
rotary kernel's fused store (`qk_norm_rope_store_kv`) and read by the decode and prefill
kernels. Judged as in tests/test_fp8_e2e.py (transformers on the
dequantized weights, near-ties only), with fewer tokens: the interpreter is slow (two prompts,
three tokens each: one prefill and two decode steps through every kernel) and one layer (each
kernel runs in every step either way; two layers took 2.5 times as long: 78 s against 31 s
for MoE).
"""

from __future__ import annotations

import pytest

from tests.fp8_cases import (
    NEAR_TIE_NATS_FP8_KV,
    build_fp8_checkpoints,
    judge,
    load_hf,
    make_prompts,
)
from tests.test_fp8_e2e import generate

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_fp8_triton_kernels_match_dequantized_reference(tmp_path, moe):
    ckpts = build_fp8_checkpoints(tmp_path, moe=moe, num_layers=1)
    model = load_hf(ckpts.dequantized)
    prompts = make_prompts(model.config.vocab_size)[1:3]
    tokens = generate(
        ckpts.fp8, prompts, max_tokens=3, attention_backend="triton", kv_cache_dtype="fp8"
    )
    agreement = judge(model, prompts, tokens)
    print(agreement.report(f"{'MoE' if moe else 'dense'} fp8 + fp8 KV, Triton (interpreter)"))
    assert agreement.num_tokens >= len(prompts)
    assert agreement.max_gap < NEAR_TIE_NATS_FP8_KV, agreement.report("fp8 + fp8 KV")
